"""spec.autotune and spec.autoscaling as the pilot reads them, the basis its measured outcomes hold
for, and the pods it scrapes."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.autoscale import ScalingSpec
from kvpilot.operator.autoscale.scaling_spec import Forecasting
from kvpilot.operator.autotune import TuningSpec
from kvpilot.operator.model_source import SpecError
from kvpilot.operator.pilot import classify
from kvpilot.operator.pilot_spec import measurement_basis, scaling_spec, seconds, tuning_spec
from kvpilot.operator.spec import InferenceServiceSpec


def _spec(**fields: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({"model": {"source": "embedded"}, **fields})


def test_the_crd_defaults_are_the_autotuners_and_the_autoscalers() -> None:
    """The article's rule (queue over 100: 8 and swap; else 16 and recompute) and HPA's behavior."""
    spec = _spec()
    assert tuning_spec(spec.autotune) == TuningSpec()
    assert scaling_spec(spec.autoscaling) == ScalingSpec(forecast=Forecasting())  # builtin forecasts


def test_every_field_reaches_the_tuning_spec() -> None:
    tuning = tuning_spec(_spec(autotune={
        "enabled": True, "interval": "30s", "cooldown": "5m", "minDwell": "2m", "apply": "rollout",
        "allowedBlockSizes": [16, 32], "pressure": {"blockSize": 32}, "calm": {"preemptionMode": "swap"},
        "thresholds": {"queueDepthHigh": 20, "queueDepthLow": 5, "swapMinContextTokens": 1024},
        "slo": {"ttftP99Seconds": 2}, "maxNumSeqs": {"min": 64, "max": 512},
        "canary": {"window": "1m", "timeout": "10m", "minRequests": 20, "tolerance": 0.1}}).autotune)
    assert (tuning.interval_s, tuning.cooldown_s, tuning.min_dwell_s, tuning.apply) == (30, 300, 120, "rollout")
    assert (tuning.pressure.block_size, tuning.pressure.preemption_mode) == (32, "swap")
    assert (tuning.calm.block_size, tuning.calm.preemption_mode) == (16, "swap")
    assert (tuning.thresholds.queue_depth_high, tuning.thresholds.queue_depth_low) == (20, 5)
    assert tuning.thresholds.swap_min_context_tokens == 1024 and tuning.slo.ttft_p99_s == 2
    assert (tuning.max_num_seqs.min, tuning.max_num_seqs.max) == (64, 512)  # type: ignore[union-attr]
    assert tuning.max_num_batched_tokens is None
    assert (tuning.canary.window_s, tuning.canary.timeout_s, tuning.canary.min_requests) == (60, 600, 20)


def test_every_field_reaches_the_scaling_spec() -> None:
    scaling = scaling_spec(_spec(autoscaling={
        "enabled": True, "mode": "keda", "metric": "ttftP99", "target": 1.5, "tolerance": 0.2, "window": "2m",
        "interval": "30s", "prometheusAddress": "http://prometheus:9090",
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 60,
                                   "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}}}).autoscaling)
    assert (scaling.mode, scaling.metric, scaling.target, scaling.tolerance) == ("keda", "ttftP99", 1.5, 0.2)
    assert (scaling.window, scaling.interval) == (120, 30)
    assert scaling.behavior.scale_down.stabilization_window_s == 60
    assert [(p.type, p.value, p.period_s) for p in scaling.behavior.scale_down.policies] == [("Pods", 1, 60)]
    assert scaling.behavior.scale_up == ScalingSpec().behavior.scale_up


@pytest.mark.parametrize(("fields", "problem"), [
    ({"autotune": {"canary": {"window": "1h", "timeout": "5m"}}}, "spec.autotune: timeout_s"),
    ({"autotune": {"maxNumSeqs": {"min": 64, "max": 8}}}, "spec.autotune: min"),
    ({"autoscaling": {"mode": "hpa", "window": "1m"}}, "spec.autoscaling: window_s"),
    ({"autoscaling": {"prometheusAddress": "http://p:9090"}}, "spec.autoscaling: prometheus_address"),
])
def test_what_the_schema_cannot_say_is_a_spec_error(fields: dict[str, Any], problem: str) -> None:
    spec = _spec(**fields)
    with pytest.raises(SpecError, match=problem):
        tuning_spec(spec.autotune)
        scaling_spec(spec.autoscaling)


def test_durations() -> None:
    assert [seconds(d) for d in ("45s", "10m", "2h")] == [45, 600, 7200]
    with pytest.raises(ValueError, match="not a duration"):
        seconds("1m30s")


def _pod(name: str, ready: bool = True, ip: str | None = "10.0.0.1", **extra: Any) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    pod = {"metadata": {"name": name}, "spec": {"containers": [{"name": "server", "ports": [
        {"name": "http", "containerPort": 8000}]}]}, "status": {"phase": "Running", "conditions": conditions}}
    if ip:
        pod["status"]["podIP"] = ip
    for key, value in extra.items():
        pod[key].update(value)
    return pod


def test_only_ready_pods_with_an_ip_are_scraped_and_leaving_ones_are_not_counted() -> None:
    pods = classify([
        _pod("a"), _pod("b", ready=False), _pod("c", ip=None),
        _pod("d", metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"}),
        _pod("e", status={"phase": "Failed"}),
        _pod("f", metadata={"annotations": {"controller.kubernetes.io/pod-deletion-cost": "300"}}),
    ])
    assert pods.states == {"a": "ready", "b": "starting", "c": "starting", "d": "leaving", "e": "leaving",
                           "f": "ready"}
    assert [(e.pod, e.url("/metrics")) for e in pods.endpoints] == [
        ("a", "http://10.0.0.1:8000/metrics"), ("f", "http://10.0.0.1:8000/metrics")]
    assert pods.deletion_costs["f"] == "300" and pods.deletion_costs["a"] is None
    assert pods.templates == frozenset()  # no pod-template-hash: not a Deployment's pods


def test_the_pod_templates_of_pods_in_any_state_are_collected() -> None:
    """Two templates while a rollout replaces pods: a new one still starting counts, as does an
    old one on its way out."""
    labels = lambda h: {"labels": {"pod-template-hash": h}}  # noqa: E731
    rolling = classify([_pod("a", metadata=labels("old")), _pod("b", ready=False, metadata=labels("new")),
                        _pod("c", metadata={**labels("old"), "deletionTimestamp": "2026-01-01T00:00:00Z"})])
    assert rolling.templates == {"old", "new"}
    assert classify([_pod("a", metadata=labels("new")), _pod("b", metadata=labels("new"))]).templates == {"new"}


BASE = {"model": {"source": "hf://org/model"}, "engine": {"swapSpace": 8}}


def _basis(spec: dict[str, Any], image: str = "registry/runtime:1") -> dict[str, str]:
    return dict(measurement_basis(InferenceServiceSpec.model_validate(spec), image))


def test_the_basis_names_the_model_image_gpus_placement_and_the_engine_flags_set() -> None:
    assert _basis(BASE) == {"model": "hf://org/model (auto, auto, quantization none)", "image": "registry/runtime:1",
                            "gpus": "1 a pod, tensor parallel 1", "placement": "any node", "engine": "swapSpace=8.0"}


@pytest.mark.parametrize("edit", [
    {"model": {"source": "hf://org/other"}}, {"model": {"source": "hf://org/model", "dtype": "float16"}},
    {"resources": {"gpus": 2}}, {"tensorParallelSize": 2},
    {"placement": {"nodeSelector": {"nvidia.com/gpu.product": "H200"}}},
    {"placement": {"affinity": {"nodeAffinity": {}}}},
    {"engine": {"swapSpace": 8, "maxModelLen": 4096}}, {"engine": {"swapSpace": 8, "gpuMemoryUtilization": 0.8}},
    {"engine": {"swapSpace": 8, "maxNumSeqs": 128}}, {"engine": {"swapSpace": 4}},
])
def test_what_changes_a_configurations_capacity_changes_the_basis(edit: dict[str, Any]) -> None:
    assert _basis({**BASE, **edit}) != _basis(BASE)


@pytest.mark.parametrize("edit", [
    # the tuned knobs, logging and metrics, the queue's bound, the seed, the replicas, both loops
    {"engine": {"swapSpace": 8, "blockSize": 32, "preemptionMode": "swap", "disableLogStats": True,
                "metricInterval": 5, "maxQueueLen": 10, "seed": 3}},
    {"engine": {"swapSpace": 8, "maxNumSeqs": 256}},  # a default spelled out
    {"replicas": 3, "autotune": {"enabled": True}, "autoscaling": {"enabled": True, "maxReplicas": 9}},
    {"podLabels": {"team": "a"}, "resources": {"gpus": 1, "memory": "32Gi"}},
])
def test_what_leaves_a_configurations_capacity_alone_keeps_the_basis(edit: dict[str, Any]) -> None:
    assert _basis({**BASE, **edit}) == _basis(BASE)


def test_another_image_is_another_basis() -> None:
    assert _basis(BASE, "registry/runtime:2") != _basis(BASE)
