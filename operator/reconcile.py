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
import dataclasses
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import pydantic

from kvpilot.runtime.tunables import LiveConfig

from .autoscale.hpa import build_hpa
from .autoscale.keda import KEDA_GROUP, KEDA_VERSION, build_scaled_object, missing_api
from .autoscale.scaling_spec import ScalingSpec
from .autotune.tuning_spec import TuningSpec
from .compare import covers
from .kube import Kube
from .manifests import (
    SPEC_HASH_ANNOTATION,
    TUNED_CONFIG_KEY,
    Manifest,
    Owner,
    build_admin_secret,
    build_deployment,
    build_pdb,
    build_service,
    build_tuned_config_map,
    child_metadata,
    selector_string,
    tunes_live,
    with_spec_hash,
)
from .model_source import ModelSource, SpecError, resolve_model_source
from .monitoring import EngineMonitoring, build_pod_monitor
from .pilot_spec import scaling_spec, tuning_spec
from .spec import InferenceServiceSpec
from .status import build_status, condition, engine_failure

MONITORING_GROUP, MONITORING_VERSION = "monitoring.coreos.com", "v1"


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
    desired: Desired | None = None
    tuned: LiveConfig | None = None  # the tuned config this reconcile wrote into the ConfigMap or flags


@dataclass(frozen=True)
class Desired:
    owner: Owner
    spec: InferenceServiceSpec
    source: ModelSource
    tuning: TuningSpec
    scaling: ScalingSpec


@dataclass(frozen=True)
class Extras:
    """What the reconcile takes besides the InferenceService: the operator's settings and the
    pilot's tuned config (None until it tuned something)."""

    tuned: LiveConfig | None = None
    # whether `tuned` is a pilot's view; without one (no pilot runs yet, as after an operator
    # start) the reconcile keeps what an earlier operator left (`recorded_tuned`), so that a
    # restart rolls no pod and rewrites no ConfigMap
    tuned_by_pilot: bool = False
    monitoring: EngineMonitoring = EngineMonitoring()
    prometheus_address: str | None = None  # KEDA's Prometheus when the spec names none
    engine_cache_host_path: str | None = None  # a node folder every engine pod's caches share


def parse(body: Any) -> Desired:
    """The InferenceService as typed values; SpecError if it cannot work."""
    try:
        spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise SpecError(f"spec.{where}: {first['msg']}") from exc
    return Desired(owner=Owner.from_body(body), spec=spec, source=resolve_model_source(spec.model.source),
                   tuning=tuning_spec(spec.autotune), scaling=scaling_spec(spec.autoscaling))


def with_tuned(spec: InferenceServiceSpec, tuned: LiveConfig | None) -> InferenceServiceSpec:
    """`spec` with the tuned live values in its engine section."""
    if tuned is None:
        return spec
    engine = spec.engine.model_copy(update=tuned.to_json())  # spec.engine's fields are the tunables' names
    return spec.model_copy(update={"engine": engine})


def _served(groups: Manifest) -> set[tuple[str, str]]:
    return {(g["name"], v["version"]) for g in groups.get("groups") or [] for v in g.get("versions") or []}


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


def recorded_tuned(kube: Kube, desired: Desired, status: Manifest) -> LiveConfig | None:
    """The tuned config an earlier operator left: with `apply: live` the ConfigMap's (what pods
    start on; a reconcile writes it before status, so it is never the older of the two), else
    `status.tuning.config`."""
    owner = desired.owner
    if tunes_live(desired.spec):
        config_map = kube.get("ConfigMap", owner.namespace, owner.tuned_config_name) or {}
        try:
            values = json.loads((config_map.get("data") or {}).get(TUNED_CONFIG_KEY) or "{}")
            return LiveConfig.from_json(values)
        except (ValueError, TypeError):  # {} before the first change, or not ours to read
            pass
    return LiveConfig.from_status((status.get("tuning") or {}).get("config"))


def _tuned_config(kube: Kube, desired: Desired, tuned: LiveConfig | None, changes: list[Change]) -> None:
    """The ConfigMap a pod started later reads its tuned config from (apply: live)."""
    owner = desired.owner
    if tunes_live(desired.spec):
        values = {} if tuned is None else dataclasses.asdict(tuned)
        apply(kube, owner, build_tuned_config_map(owner, values), changes)
    else:
        _delete_owned(kube, "ConfigMap", owner, owner.tuned_config_name, changes)


def _autoscaler(kube: Kube, desired: Desired, extras: Extras, served: set[tuple[str, str]],
                changes: list[Change]) -> Manifest | None:
    """The HPA or ScaledObject of modes hpa and keda; the ScalingActive condition where this
    reconcile decides it (None: the pilot does, in mode builtin, or autoscaling is off)."""
    owner, scaling = desired.owner, desired.scaling
    mode = scaling.mode if scaling.enabled else None
    keda_served = (KEDA_GROUP, KEDA_VERSION) in served
    if mode != "hpa":
        _delete_owned(kube, "HorizontalPodAutoscaler", owner, owner.name, changes)
    if mode != "keda" and keda_served:
        _delete_owned(kube, "ScaledObject", owner, owner.name, changes)
    groups = {"groups": [{"name": g, "versions": [{"version": v}]} for g, v in served]}
    if mode == "hpa":
        apply(kube, owner, with_spec_hash(build_hpa(owner.name, scaling, child_metadata(owner, owner.name))), changes)
        missing = missing_api(groups, "hpa")
        if missing is not None:
            return condition("ScalingActive", False, missing.reason, missing.message)
        return condition("ScalingActive", True, "HorizontalPodAutoscaler",
                         f"HorizontalPodAutoscaler {owner.name} scales on {scaling.metric} (target {scaling.target:g})")
    if mode == "keda":
        missing = missing_api(groups, "keda")
        if missing is not None:
            return condition("ScalingActive", False, missing.reason, missing.message)
        try:
            scaled_object = build_scaled_object(owner.name, scaling, child_metadata(owner, owner.name),
                                                default_prometheus_address=extras.prometheus_address)
        except ValueError as exc:
            return condition("ScalingActive", False, "PrometheusAddressMissing", str(exc).partition(": ")[2])
        apply(kube, owner, with_spec_hash(scaled_object), changes)
        return condition("ScalingActive", True, "ScaledObject",
                         f"KEDA ScaledObject {owner.name} scales on {scaling.metric} (target {scaling.target:g})")
    if mode is None:
        return condition("ScalingActive", False, "AutoscalingDisabled", "spec.autoscaling.enabled is false")
    return None


def _pod_monitor(kube: Kube, owner: Owner, monitoring: EngineMonitoring, served: set[tuple[str, str]],
                 changes: list[Change]) -> Manifest:
    """The PodMonitor (operator flag --engine-monitoring) and the Monitored condition."""
    if not monitoring.enabled:
        return condition("Monitored", False, "MonitoringDisabled",
                         "the operator runs without --engine-monitoring (chart: engineMonitoring.enabled)")
    if (MONITORING_GROUP, MONITORING_VERSION) not in served:
        return condition("Monitored", False, "PodMonitorApiMissing",
                         f"the API server serves no {MONITORING_GROUP}/{MONITORING_VERSION}: install the "
                         f"prometheus-operator CRDs so a PodMonitor can make Prometheus scrape the engines")
    apply(kube, owner, build_pod_monitor(owner, monitoring), changes)
    return condition("Monitored", True, "PodMonitor", f"PodMonitor {owner.name} scrapes every engine pod")


def reconcile(kube: Kube, body: Any, image: str, now: str, extras: Extras = Extras()) -> Outcome:
    desired = parse(body)
    owner, spec, source = desired.owner, desired.spec, desired.source
    tuned = None
    if spec.autotune.enabled:
        tuned = extras.tuned if extras.tuned_by_pilot else recorded_tuned(kube, desired, body.get("status") or {})
    tuned_spec = with_tuned(spec, tuned)
    changes: list[Change] = []
    ensure_admin_secret(kube, owner, changes)
    _tuned_config(kube, desired, tuned, changes)
    pod_spec = tuned_spec if spec.autotune.apply == "rollout" else spec
    deployment = apply(kube, owner, build_deployment(owner, pod_spec, source, spec.image or image,
                                                     extras.engine_cache_host_path), changes)
    apply(kube, owner, build_service(owner), changes)
    if spec.pod_disruption_budget.enabled:
        apply(kube, owner, build_pdb(owner, spec), changes)
    else:
        _delete_owned(kube, "PodDisruptionBudget", owner, owner.name, changes)
    served = _served(kube.api_groups())
    extra_conditions = [_pod_monitor(kube, owner, extras.monitoring, served, changes)]
    if (failed := engine_failure(kube.list_objects("Pod", owner.namespace, selector_string(owner)))) is not None:
        extra_conditions.append(failed)  # overrides the rollout's Degraded: the pods say why they do not start
    if (scaling := _autoscaler(kube, desired, extras, served, changes)) is not None:
        extra_conditions.append(scaling)
    generation = body.get("metadata", {}).get("generation", 0)
    status = build_status(body.get("status") or {}, generation, owner, tuned_spec, source, deployment, now,
                          extra_conditions)
    return Outcome(status=status, changes=changes, desired=desired, tuned=tuned)
