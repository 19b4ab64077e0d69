"""Reconciliation: make the cluster hold what the builders say, and report what it holds.

Each child is read, then created, replaced or scaled; an unchanged child costs a GET. It is
replaced when the spec moved (its spec-hash annotation differs: this also catches a field the
spec no longer sets) or when a hand edit changed a field the operator sets (`compare.covers`:
`kubectl set image` is rolled back); only scaled when just the replica count differs. Replacing
uses the live resourceVersion, so a concurrent writer makes the API server answer 409 and the
key is retried on fresh data. Deleting is the garbage collector's job (ownerReferences), so
deletion never waits for the operator.
"""

from __future__ import annotations

import copy
import secrets
from dataclasses import dataclass, field
from typing import Any

import pydantic

from .compare import covers
from .kube import Kube
from .manifests import (
    SPEC_HASH_ANNOTATION,
    Manifest,
    Owner,
    build_admin_secret,
    build_deployment,
    build_pdb,
    build_service,
)
from .model_source import ModelSource, SpecError, resolve_model_source
from .spec import InferenceServiceSpec
from .status import build_status


@dataclass(frozen=True)
class Change:
    action: str  # Created, Updated, Scaled, Deleted
    kind: str
    name: str
    detail: str = ""

    @property
    def message(self) -> str:
        text = f"{self.action} {self.kind} {self.name}"
        return f"{text}: {self.detail}" if self.detail else text


@dataclass
class Outcome:
    status: Manifest
    changes: list[Change] = field(default_factory=list)


@dataclass(frozen=True)
class Desired:
    owner: Owner
    spec: InferenceServiceSpec
    source: ModelSource


def parse(body: Any) -> Desired:
    """The InferenceService as typed values; SpecError if it cannot work."""
    try:
        spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise SpecError(f"spec.{where}: {first['msg']}") from exc
    return Desired(owner=Owner.from_body(body), spec=spec, source=resolve_model_source(spec.model.source))


def _is_owned_by(obj: Manifest, owner: Owner) -> bool:
    for ref in obj.get("metadata", {}).get("ownerReferences", []) or []:
        if ref.get("kind") == "InferenceService" and ref.get("name") == owner.name:
            return not owner.uid or ref.get("uid") == owner.uid
    return False


def _check_owned(obj: Manifest, owner: Owner) -> None:
    if not _is_owned_by(obj, owner):
        raise SpecError(f"{obj.get('kind')} {obj['metadata']['name']} already exists and is not owned "
                        f"by InferenceService {owner.name}; rename one of them")


def _replacement(desired: Manifest, live: Manifest) -> Manifest:
    """`desired`, keeping what others own on the live object (their labels and annotations,
    a Service's allocated cluster IPs), at the live resourceVersion."""
    body = copy.deepcopy(desired)
    live_meta, meta = live.get("metadata", {}), body["metadata"]
    meta["resourceVersion"] = live_meta.get("resourceVersion")
    meta["labels"] = {**(live_meta.get("labels") or {}), **meta.get("labels", {})}
    meta["annotations"] = {**(live_meta.get("annotations") or {}), **meta.get("annotations", {})}
    if body["kind"] == "Service":
        for key in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
            if key in live.get("spec", {}):
                body["spec"][key] = live["spec"][key]
    return body


def _drift(live: Manifest, desired: Manifest) -> str | None:
    """Why `live` must be replaced by `desired`, or None; the replica count is left to `apply`."""
    live_hash = (live["metadata"].get("annotations") or {}).get(SPEC_HASH_ANNOTATION)
    if live_hash != desired["metadata"]["annotations"][SPEC_HASH_ANNOTATION]:
        return "rolling out the new pod template" if desired["kind"] == "Deployment" else "spec changed"
    essence = copy.deepcopy(desired)
    essence.get("spec", {}).pop("replicas", None)
    meta = essence["metadata"]
    essence["metadata"] = {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
    return None if covers(live, essence) else "repairing a change made by hand"


def apply(kube: Kube, owner: Owner, desired: Manifest, changes: list[Change]) -> Manifest:
    kind, meta = desired["kind"], desired["metadata"]
    live = kube.get(kind, meta["namespace"], meta["name"])
    if live is None:
        changes.append(Change("Created", kind, meta["name"]))
        return kube.create(desired)
    _check_owned(live, owner)
    if (why := _drift(live, desired)) is not None:
        changes.append(Change("Updated", kind, meta["name"], why))
        return kube.replace(_replacement(desired, live))
    want = desired.get("spec", {}).get("replicas")
    have = live.get("spec", {}).get("replicas")
    if want is not None and want != have:
        changes.append(Change("Scaled", kind, meta["name"], f"replicas {have} -> {want}"))
        return kube.patch(kind, meta["namespace"], meta["name"], {"spec": {"replicas": want}})
    return live


def ensure_admin_secret(kube: Kube, owner: Owner, changes: list[Change]) -> None:
    """Created once with a random token; never rewritten, so the token stays stable."""
    live = kube.get("Secret", owner.namespace, owner.admin_secret_name)
    if live is not None:
        _check_owned(live, owner)
        return
    kube.create(build_admin_secret(owner, secrets.token_urlsafe(32)))
    changes.append(Change("Created", "Secret", owner.admin_secret_name, "admin token for /admin/config"))


def _delete_owned(kube: Kube, kind: str, owner: Owner, name: str, changes: list[Change]) -> None:
    live = kube.get(kind, owner.namespace, name)
    if live is not None and _is_owned_by(live, owner) and kube.delete(kind, owner.namespace, name):
        changes.append(Change("Deleted", kind, name))


def reconcile(kube: Kube, body: Any, image: str, now: str) -> Outcome:
    desired = parse(body)
    owner, spec, source = desired.owner, desired.spec, desired.source
    changes: list[Change] = []
    ensure_admin_secret(kube, owner, changes)
    deployment = apply(kube, owner, build_deployment(owner, spec, source, spec.image or image), changes)
    apply(kube, owner, build_service(owner), changes)
    if spec.pod_disruption_budget.enabled:
        apply(kube, owner, build_pdb(owner, spec), changes)
    else:
        _delete_owned(kube, "PodDisruptionBudget", owner, owner.name, changes)
    generation = body.get("metadata", {}).get("generation", 0)
    status = build_status(body.get("status") or {}, generation, owner, spec, source, deployment, now)
    return Outcome(status=status, changes=changes)
