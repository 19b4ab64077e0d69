"""InferenceServices on a real API server, as the tests drive and read them (kubectl)."""

from __future__ import annotations

import json
from typing import Any

from kube_control_plane import ControlPlane, eventually

CHILDREN = (("deployment", "{}"), ("service", "{}"), ("secret", "{}-admin"), ("poddisruptionbudget", "{}"))
SELECTOR = "serving.kvpilot.io/inferenceservice={}"


def new_namespace(plane: ControlPlane, name: str) -> str:
    plane.kubectl("create", "namespace", name)
    return name


def create(plane: ControlPlane, namespace: str, name: str, spec: dict[str, Any] | None = None) -> None:
    body = {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec or {"model": {"source": "embedded"}, "resources": {"gpus": 0}}}
    done = plane.apply(body)
    assert done.returncode == 0, done.stderr


def children(plane: ControlPlane, namespace: str, name: str) -> dict[str, dict[str, Any]] | None:
    found = {kind: plane.get(kind, pattern.format(name), namespace) for kind, pattern in CHILDREN}
    return None if None in found.values() else found  # type: ignore[return-value]


def reconciled(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    """The InferenceService once its children exist and its status describes its generation."""
    eventually(lambda: children(plane, namespace, name), what=f"the children of {namespace}/{name}")

    def observed() -> dict[str, Any] | None:
        obj = plane.get("inferenceservice", name, namespace)
        done = obj and obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
        return obj if done else None
    return eventually(observed, what=f"the status of {namespace}/{name}")  # type: ignore[no-any-return]


def events(plane: ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    items = json.loads(plane.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
    return [e for e in items if e["involvedObject"]["name"] == name and e["involvedObject"]["kind"] == "InferenceService"]


def condition(obj: dict[str, Any] | None, type_: str) -> tuple[str, str] | None:
    for cond in (obj or {}).get("status", {}).get("conditions", []):
        if cond["type"] == type_:
            return cond["status"], cond["reason"]
    return None


def rolled_out(plane: ControlPlane, namespace: str, name: str) -> bool:
    """Play the kubelet until the Deployment reports every pod updated and available."""
    plane.mark_pods_ready(namespace, SELECTOR.format(name))
    deployment = plane.get("deployment", name, namespace) or {}
    status, want = deployment.get("status", {}), deployment.get("spec", {}).get("replicas")
    return status.get("observedGeneration") == deployment["metadata"]["generation"] and \
        status.get("updatedReplicas") == status.get("availableReplicas") == status.get("replicas") == want
