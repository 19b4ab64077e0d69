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
