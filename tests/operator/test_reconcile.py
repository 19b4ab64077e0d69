"""The reconciler against an in-memory API: creates once, then writes only what changed."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from kvpilot.operator.kube import ApiError
from kvpilot.operator.manifests import SPEC_HASH_ANNOTATION
from kvpilot.operator.model_source import SpecError
from kvpilot.operator.reconcile import reconcile


class FakeKube:
    def __init__(self) -> None:
        self.served = [("autoscaling", "v2")]  # discovery: (group, version) the API server serves
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str, str]] = []
        self.version = 0
        self.fail_next: ApiError | None = None

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        meta = obj["metadata"]
        self.objects[obj["kind"], meta["namespace"], meta["name"]] = obj
        return copy.deepcopy(obj)

    def _write(self, verb: str, kind: str, name: str) -> None:
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        self.writes.append((verb, kind, name))

    def api_groups(self) -> dict[str, Any]:
        return {"groups": [{"name": g, "versions": [{"version": v}]} for g, v in self.served]}

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def list_objects(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        wanted = dict(pair.split("=", 1) for pair in selector.split(","))
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace
                and wanted.items() <= (o["metadata"].get("labels") or {}).items()]

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._write("create", obj["kind"], obj["metadata"]["name"])
        if (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]) in self.objects:
            raise ApiError(409, "AlreadyExists")
        return self._store(obj)

    def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._write("replace", obj["kind"], obj["metadata"]["name"])
        live = self.objects[obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]]
        if obj["metadata"].get("resourceVersion") != live["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict")
        return self._store(obj)

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        self._write("patch", kind, name)
        obj = self.objects[kind, namespace, name]
        obj["spec"].update(patch.get("spec", {}))
        return self._store(obj)

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        self._write("delete", kind, name)
        return self.objects.pop((kind, namespace, name), None) is not None


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


def _run(kube: FakeKube, body: dict[str, Any]) -> Any:
    return reconcile(kube, body, "kvpilot:test", "2026-01-01T00:00:00Z")  # type: ignore[arg-type]


def test_first_reconcile_creates_every_child(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    outcome = _run(kube, make_isvc({"model": {"source": "embedded"}}))
    assert {(c.action, c.kind) for c in outcome.changes} == {
        ("Created", "Secret"), ("Created", "Deployment"), ("Created", "Service"), ("Created", "PodDisruptionBudget")}
    assert outcome.status["url"] == "http://llama.default.svc:8000"


def test_second_reconcile_writes_nothing(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    body = make_isvc({"model": {"source": "embedded"}})
    first = _run(kube, body)
    kube.writes.clear()
    body["status"] = first.status
    again = _run(kube, body)
    assert kube.writes == [] and again.changes == []
    assert again.status == first.status


def test_admin_token_is_generated_once(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    body = make_isvc({"model": {"source": "embedded"}})
    _run(kube, body)
    token = kube.objects["Secret", "default", "llama-admin"]["stringData"]["token"]
    _run(kube, make_isvc({"model": {"source": "embedded"}, "engine": {"blockSize": 32}}))
    assert kube.objects["Secret", "default", "llama-admin"]["stringData"]["token"] == token
    assert len(token) >= 32


def test_spec_change_replaces_the_deployment(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    _run(kube, make_isvc({"model": {"source": "embedded"}}))
    before = kube.objects["Deployment", "default", "llama"]["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    kube.writes.clear()
    outcome = _run(kube, make_isvc({"model": {"source": "embedded"}, "engine": {"blockSize": 32}}))
    assert kube.writes == [("replace", "Deployment", "llama")]
    assert [c.action for c in outcome.changes] == ["Updated"]
    deployment = kube.objects["Deployment", "default", "llama"]
    assert deployment["metadata"]["annotations"][SPEC_HASH_ANNOTATION] != before
    assert "32" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_replica_change_scales_without_rolling(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    _run(kube, make_isvc({"model": {"source": "embedded"}}))
    kube.writes.clear()
    outcome = _run(kube, make_isvc({"model": {"source": "embedded"}, "replicas": 3}))
    assert kube.writes == [("patch", "Deployment", "llama")]
    assert outcome.changes[0].detail == "replicas 1 -> 3"
    assert kube.objects["Deployment", "default", "llama"]["spec"]["replicas"] == 3


def test_replace_keeps_annotations_others_wrote(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    _run(kube, make_isvc({"model": {"source": "embedded"}}))
    kube.objects["Deployment", "default", "llama"]["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "1"
    _run(kube, make_isvc({"model": {"source": "embedded"}, "engine": {"blockSize": 8}}))
    annotations = kube.objects["Deployment", "default", "llama"]["metadata"]["annotations"]
    assert annotations["deployment.kubernetes.io/revision"] == "1"


def test_disabling_the_pdb_deletes_it(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    _run(kube, make_isvc({"model": {"source": "embedded"}}))
    _run(kube, make_isvc({"model": {"source": "embedded"}, "podDisruptionBudget": {"enabled": False}}))
    assert ("PodDisruptionBudget", "default", "llama") not in kube.objects


def test_a_foreign_object_with_our_name_is_a_spec_error(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    kube.objects["Deployment", "default", "llama"] = {"kind": "Deployment", "metadata": {"name": "llama"}, "spec": {}}
    with pytest.raises(SpecError, match="not owned by InferenceService llama"):
        _run(kube, make_isvc({"model": {"source": "embedded"}}))


def test_unknown_model_scheme_is_a_spec_error_before_any_write(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    with pytest.raises(SpecError, match="unsupported scheme 's3://'"):
        _run(kube, make_isvc({"model": {"source": "s3://bucket/llama"}}))
    assert kube.writes == []


def test_api_errors_propagate_for_the_handler_to_retry(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    kube.fail_next = ApiError(503, "ServiceUnavailable")
    with pytest.raises(ApiError):
        _run(kube, make_isvc({"model": {"source": "embedded"}}))
    _run(kube, make_isvc({"model": {"source": "embedded"}}))
    assert ("Deployment", "default", "llama") in kube.objects


def test_a_hand_edited_image_is_rolled_back(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    """`kubectl set image` leaves the spec-hash annotation as it was: the fields themselves tell."""
    _run(kube, make_isvc({"model": {"source": "embedded"}}))
    container = kube.objects["Deployment", "default", "llama"]["spec"]["template"]["spec"]["containers"][0]
    container["image"] = "other:1"
    kube.writes.clear()
    outcome = _run(kube, make_isvc({"model": {"source": "embedded"}}))
    assert kube.writes == [("replace", "Deployment", "llama")]
    assert outcome.changes[0].detail == "repairing a change made by hand"
    live = kube.objects["Deployment", "default", "llama"]["spec"]["template"]["spec"]["containers"][0]
    assert live["image"] == "kvpilot:test"


def test_fields_the_api_server_adds_or_rewrites_are_not_drift(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    """Defaults the API server fills in, quantities it canonicalises and labels others add."""
    _run(kube, make_isvc({"model": {"source": "embedded"}, "resources": {"cpu": "0.5", "gpus": 1}}))
    deployment = kube.objects["Deployment", "default", "llama"]
    pod = deployment["spec"]["template"]["spec"]
    pod["dnsPolicy"] = "ClusterFirst"
    pod["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    pod["containers"][0]["resources"]["requests"].update({"cpu": "500m", "nvidia.com/gpu": "1"})
    deployment["metadata"]["labels"]["team"] = "ml"
    kube.writes.clear()
    _run(kube, make_isvc({"model": {"source": "embedded"}, "resources": {"cpu": "0.5", "gpus": 1}}))
    assert kube.writes == []


def test_a_removed_field_rolls_out_although_the_rest_still_covers_it(kube: FakeKube,
                                                                     make_isvc: Callable[..., Any]) -> None:
    _run(kube, make_isvc({"model": {"source": "embedded"}, "placement": {"nodeSelector": {"gpu": "h200"}}}))
    kube.writes.clear()
    _run(kube, make_isvc({"model": {"source": "embedded"}}))
    assert kube.writes == [("replace", "Deployment", "llama")]
    assert "nodeSelector" not in kube.objects["Deployment", "default", "llama"]["spec"]["template"]["spec"]


def _conditions(outcome: Any) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in outcome.status["conditions"]}


def test_mode_hpa_owns_an_hpa_and_switching_mode_deletes_it(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    body = make_isvc({"model": {"source": "embedded"}, "autoscaling": {"enabled": True, "mode": "hpa"}})
    kube.served.append(("custom.metrics.k8s.io", "v1beta2"))
    outcome = _run(kube, body)
    hpa = kube.objects["HorizontalPodAutoscaler", "default", "llama"]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "InferenceService"
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert _conditions(outcome)["ScalingActive"] == ("True", "HorizontalPodAutoscaler")
    body["spec"]["autoscaling"]["mode"] = "builtin"
    outcome = _run(kube, body)
    assert ("HorizontalPodAutoscaler", "default", "llama") not in kube.objects
    assert "ScalingActive" not in _conditions(outcome)  # the pilot's, in mode builtin


def test_mode_hpa_without_custom_metrics_still_creates_the_hpa_and_says_why_it_cannot_scale(
        kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    outcome = _run(kube, make_isvc({"model": {"source": "embedded"}, "autoscaling": {"enabled": True, "mode": "hpa"}}))
    assert ("HorizontalPodAutoscaler", "default", "llama") in kube.objects
    assert _conditions(outcome)["ScalingActive"] == ("False", "CustomMetricsUnavailable")


def test_mode_keda_creates_a_scaled_object_only_where_keda_is_served(kube: FakeKube,
                                                                     make_isvc: Callable[..., Any]) -> None:
    from kvpilot.operator.reconcile import Extras

    body = make_isvc({"model": {"source": "embedded"}, "autoscaling": {"enabled": True, "mode": "keda"}})
    extras = Extras(prometheus_address="http://prometheus.monitoring.svc:9090")
    outcome = reconcile(kube, body, "kvpilot:test", "2026-01-01T00:00:00Z", extras)  # type: ignore[arg-type]
    assert _conditions(outcome)["ScalingActive"] == ("False", "KedaNotInstalled")
    assert not [k for k in kube.objects if k[0] == "ScaledObject"]
    kube.served.append(("keda.sh", "v1alpha1"))
    no_address = _run(kube, body)
    assert _conditions(no_address)["ScalingActive"][1] == "PrometheusAddressMissing"
    outcome = reconcile(kube, body, "kvpilot:test", "2026-01-01T00:00:00Z", extras)  # type: ignore[arg-type]
    scaled = kube.objects["ScaledObject", "default", "llama"]
    assert scaled["spec"]["triggers"][0]["metadata"]["serverAddress"] == "http://prometheus.monitoring.svc:9090"
    assert _conditions(outcome)["ScalingActive"] == ("True", "ScaledObject")


def test_engine_monitoring_creates_a_pod_monitor_where_its_api_is_served(kube: FakeKube,
                                                                         make_isvc: Callable[..., Any]) -> None:
    from kvpilot.operator.monitoring import EngineMonitoring
    from kvpilot.operator.reconcile import Extras

    body, extras = make_isvc({"model": {"source": "embedded"}}), Extras(monitoring=EngineMonitoring(enabled=True))
    outcome = reconcile(kube, body, "kvpilot:test", "2026-01-01T00:00:00Z", extras)  # type: ignore[arg-type]
    assert _conditions(outcome)["Monitored"] == ("False", "PodMonitorApiMissing")
    kube.served.append(("monitoring.coreos.com", "v1"))
    outcome = reconcile(kube, body, "kvpilot:test", "2026-01-01T00:00:00Z", extras)  # type: ignore[arg-type]
    assert kube.objects["PodMonitor", "default", "llama"]["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert _conditions(outcome)["Monitored"] == ("True", "PodMonitor")
    assert _conditions(_run(kube, body))["Monitored"] == ("False", "MonitoringDisabled")


def test_live_tuning_mounts_the_tuned_config_map_and_rollout_tuning_writes_the_flags(
        kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    import json

    from kvpilot.operator.autotune import LiveConfig
    from kvpilot.operator.reconcile import Extras

    body = make_isvc({"model": {"source": "embedded"}, "autotune": {"enabled": True}})
    _run(kube, body)
    assert json.loads(kube.objects["ConfigMap", "default", "llama-tuned"]["data"]["tuned.json"]) == {}
    template = kube.objects["Deployment", "default", "llama"]["spec"]["template"]
    tuned = LiveConfig(8, "swap", 128, 2048)
    kube.writes.clear()
    by_pilot = Extras(tuned=tuned, tuned_by_pilot=True)
    outcome = reconcile(kube, body, "kvpilot:test", "2026-01-01T00:00:00Z", by_pilot)  # type: ignore[arg-type]
    assert json.loads(kube.objects["ConfigMap", "default", "llama-tuned"]["data"]["tuned.json"])["block_size"] == 8
    assert kube.objects["Deployment", "default", "llama"]["spec"]["template"] == template  # no pod restarts
    assert kube.writes == [("replace", "ConfigMap", "llama-tuned")]
    assert outcome.status["engineRollingOut"]["blockSize"] == 8  # the status shows the tuned config

    body["spec"]["autotune"]["apply"] = "rollout"
    reconcile(kube, body, "kvpilot:test", "2026-01-01T00:00:00Z", by_pilot)  # type: ignore[arg-type]
    args = kube.objects["Deployment", "default", "llama"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--block-size") + 1] == "8" and args[args.index("--preemption-mode") + 1] == "swap"
    assert "--tuned-config" not in args
    assert ("ConfigMap", "default", "llama-tuned") not in kube.objects


def test_a_canary_longer_than_its_timeout_is_a_spec_error(kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    body = make_isvc({"model": {"source": "embedded"}, "autotune": {"canary": {"window": "20m", "timeout": "5m"}}})
    with pytest.raises(SpecError, match=r"spec.autotune: timeout_s: must be >= window_s"):
        _run(kube, body)
    assert kube.writes == []


def test_without_a_pilot_the_reconcile_keeps_the_tuned_config_an_earlier_operator_left(
        kube: FakeKube, make_isvc: Callable[..., Any]) -> None:
    """The first reconcile after an operator start (no pilot yet): apply live keeps the ConfigMap
    (and takes it over a status that lags it), apply rollout keeps the tuned flags from status."""
    import json

    from kvpilot.operator.autotune import LiveConfig
    from kvpilot.operator.reconcile import Extras

    body = make_isvc({"model": {"source": "embedded"}, "autotune": {"enabled": True}})
    tuned = LiveConfig(8, "swap", 128, 2048)
    reconcile(kube, body, "kvpilot:test", "2026-01-01T00:00:00Z", Extras(tuned, tuned_by_pilot=True))  # type: ignore[arg-type]
    kube.writes.clear()
    outcome = _run(kube, body)  # status knows nothing of it: the ConfigMap is newer
    assert kube.writes == [] and outcome.tuned == tuned
    assert json.loads(kube.objects["ConfigMap", "default", "llama-tuned"]["data"]["tuned.json"])["block_size"] == 8

    body["spec"]["autotune"]["apply"] = "rollout"
    body["status"] = {"tuning": {"config": tuned.to_status()}}
    reconcile(kube, body, "kvpilot:test", "2026-01-01T00:00:00Z", Extras(tuned, tuned_by_pilot=True))  # type: ignore[arg-type]
    template = copy.deepcopy(kube.objects["Deployment", "default", "llama"]["spec"]["template"])
    kube.writes.clear()
    assert _run(kube, body).tuned == tuned
    assert kube.writes == [] and kube.objects["Deployment", "default", "llama"]["spec"]["template"] == template
    del body["status"]  # nothing recorded anywhere: the spec's own flags
    _run(kube, body)
    args = kube.objects["Deployment", "default", "llama"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--block-size") + 1] == "16"
