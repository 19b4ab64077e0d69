"""The engine PodMonitor: valid for prometheus-operator, selects exactly the Deployment's pods on
their serving port, labels every series as the chart's alerts expect, and is owned and hashed
like every other child."""

from __future__ import annotations

import argparse

import pytest
from monitoring_crds import monitoring_problems

from kvpilot.operator.manifests import SPEC_HASH_ANNOTATION, Owner, build_deployment
from kvpilot.operator.model_source import resolve_model_source
from kvpilot.operator.monitoring import (
    ENGINE_JOB,
    EngineMonitoring,
    add_arguments,
    build_pod_monitor,
    duration_seconds,
    from_args,
)
from kvpilot.operator.spec import InferenceServiceSpec

OWNER = Owner(name="llama", namespace="serving", uid="0b8e7c9e-1111-2222-3333-444455556666")


def _deployment() -> dict:
    spec = InferenceServiceSpec.model_validate({"model": {"source": "embedded"}})
    return build_deployment(OWNER, spec, resolve_model_source(spec.model.source), "kvpilot:test")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_pod_monitor_is_valid_for_prometheus_operator() -> None:
    pod_monitor = build_pod_monitor(OWNER, EngineMonitoring(enabled=True, labels={"release": "kps"}))
    assert monitoring_problems(pod_monitor) == []


def test_validation_catches_a_misspelt_field() -> None:
    """The check above can fail: the API server would silently prune this field."""
    pod_monitor = build_pod_monitor(OWNER, EngineMonitoring(enabled=True))
    pod_monitor["spec"]["podMetricsEndpoints"][0]["scrapeTimout"] = "5s"
    assert monitoring_problems(pod_monitor) == ["PodMonitor.spec.podMetricsEndpoints[0].scrapeTimout: unknown field"]


def test_selects_exactly_the_deployments_pods_on_their_serving_port() -> None:
    deployment = _deployment()
    endpoint, = build_pod_monitor(OWNER, EngineMonitoring())["spec"]["podMetricsEndpoints"]
    selector = build_pod_monitor(OWNER, EngineMonitoring())["spec"]["selector"]["matchLabels"]
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    container, = deployment["spec"]["template"]["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert endpoint["path"] == "/metrics"


def test_every_series_gets_the_engine_job_and_the_service_name() -> None:
    endpoint, = build_pod_monitor(OWNER, EngineMonitoring())["spec"]["podMetricsEndpoints"]
    set_labels = {r["targetLabel"]: r["replacement"] for r in endpoint["relabelings"] if r["action"] == "replace"}
    assert set_labels == {"job": ENGINE_JOB, "name": "llama"}


def test_is_owned_by_the_inference_service_in_its_namespace() -> None:
    meta = build_pod_monitor(OWNER, EngineMonitoring())["metadata"]
    assert (meta["name"], meta["namespace"]) == ("llama", "serving")
    ref, = meta["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceService", "llama", OWNER.uid, True)


def test_selection_labels_are_added_but_cannot_replace_the_operators_own() -> None:
    monitoring = EngineMonitoring(labels={"release": "kps", "app.kubernetes.io/managed-by": "someone"})
    meta_labels = build_pod_monitor(OWNER, monitoring)["metadata"]["labels"]
    assert meta_labels["release"] == "kps"
    assert meta_labels["app.kubernetes.io/managed-by"] == "kvpilot-operator"


def test_spec_hash_follows_the_scrape_settings() -> None:
    def digest(monitoring: EngineMonitoring) -> str:
        return build_pod_monitor(OWNER, monitoring)["metadata"]["annotations"][SPEC_HASH_ANNOTATION]

    assert digest(EngineMonitoring()) == digest(EngineMonitoring())
    assert digest(EngineMonitoring(interval="15s")) != digest(EngineMonitoring())


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("1m30s", 90), ("2h", 7200), ("500ms", 0.5)])
def test_durations_read_as_prometheus_operator_reads_them(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"interval": "30"}, "interval"),
    ({"interval": "s"}, "interval"),
    ({"interval": "0s"}, "interval"),
    ({"scrape_timeout": "1m", "interval": "30s"}, "scrape_timeout"),
    ({"labels": {"not a key": "x"}}, "labels"),
    ({"labels": {"release": "not a value"}}, "labels"),
])
def test_bad_settings_fail_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        EngineMonitoring(**kwargs)


def test_flags_build_the_settings() -> None:
    monitoring = from_args(_parse("--engine-monitoring", "--engine-monitoring-interval=15s",
                                  "--engine-monitoring-timeout=5s",
                                  "--engine-monitoring-label=release=kube-prometheus-stack"))
    assert monitoring == EngineMonitoring(enabled=True, interval="15s", scrape_timeout="5s",
                                          labels={"release": "kube-prometheus-stack"})
    assert from_args(_parse()).enabled is False


@pytest.mark.parametrize(("argv", "flag"), [
    (["--engine-monitoring-label=release"], "--engine-monitoring-label"),
    (["--engine-monitoring-interval=5s"], "--engine-monitoring-timeout"),
    (["--engine-monitoring-interval=soon"], "--engine-monitoring-interval"),
])
def test_bad_flags_fail_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=rf"^{flag}: "):
        from_args(_parse(*argv))
