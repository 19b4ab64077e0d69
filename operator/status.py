"""status of an InferenceService, computed from its Deployment: pure functions.

Conditions follow metav1.Condition: `lastTransitionTime` moves only when `status` flips, so a
reconcile that changes nothing writes nothing.

* Ready — every desired replica is ready (False when scaled to zero).
* Progressing — a rollout or scale is under way.
* Degraded — the spec cannot work (InvalidSpec), an API error keeps the operator from applying
  it (ApiError, retried meanwhile), a pod's engine exits with an error (EngineFailed: the last
  line of its termination message, where `kvpilot serve` writes why it could not start, e.g. a
  quantization the checkpoint contradicts), or the Deployment reports it is stuck.
* Tuned — owned by the autotuner (the pilot); here only its placeholder while autotune is off or waiting.
* ScalingActive — the autoscaler can act: its HPA or ScaledObject exists and the APIs it needs
  are served (modes hpa, keda), or the pilot's last decision had metrics (mode builtin).
* Monitored — a PodMonitor makes Prometheus scrape the engines, or why not.

`engine` is the engine configuration in force: it moves to the spec's only once the Deployment
has rolled it out to every pod (`kubectl rollout status`'s test), so the BLOCK column never shows
a block size no pod runs yet; meanwhile `engineRollingOut` shows what is coming.
"""

from __future__ import annotations

from typing import Any

from .manifests import ENGINE_CONTAINER, Owner, engine_config, selector_string, service_url
from .model_source import ModelSource
from .objects import Manifest
from .spec import InferenceServiceSpec

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Tuned", "ScalingActive", "Monitored")


def condition(type_: str, status: bool | None, reason: str, message: str) -> Manifest:
    text = "Unknown" if status is None else ("True" if status else "False")
    return {"type": type_, "status": text, "reason": reason, "message": message}


def merge_conditions(current: list[Manifest], updates: list[Manifest], generation: int,
                     now: str) -> list[Manifest]:
    """`current` with `updates` applied; transition times kept where the status did not change."""
    by_type = {c["type"]: dict(c) for c in current}
    for update in updates:
        old = by_type.get(update["type"])
        new = {**update, "observedGeneration": generation}
        same_status = old is not None and old.get("status") == update["status"]
        new["lastTransitionTime"] = old.get("lastTransitionTime", now) if same_status and old else now
        by_type[update["type"]] = new
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(by_type.values(), key=lambda c: (order.get(c["type"], len(order)), c["type"]))


def _deployment_condition(deployment: Manifest, type_: str) -> Manifest | None:
    for cond in deployment.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def rollout_conditions(deployment: Manifest | None, desired: int) -> list[Manifest]:
    """Ready, Progressing and Degraded as the Deployment reports them."""
    if deployment is None:
        return [condition("Ready", False, "DeploymentMissing", "the Deployment does not exist yet"),
                condition("Progressing", True, "Creating", "creating the Deployment"),
                condition("Degraded", False, "AsExpected", "")]
    status = deployment.get("status", {}) or {}
    generation = deployment.get("metadata", {}).get("generation", 0)
    observed = status.get("observedGeneration", 0) >= generation
    ready = status.get("readyReplicas", 0) or 0
    updated = status.get("updatedReplicas", 0) or 0
    total = status.get("replicas", 0) or 0

    stuck = _deployment_condition(deployment, "Progressing")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    if stuck is not None and stuck.get("reason") == "ProgressDeadlineExceeded":
        degraded = condition("Degraded", True, "ProgressDeadlineExceeded", stuck.get("message", ""))
    elif failure is not None and failure.get("status") == "True":
        degraded = condition("Degraded", True, failure.get("reason") or "ReplicaFailure",
                             failure.get("message", ""))
    else:
        degraded = condition("Degraded", False, "AsExpected", "")

    rolling = not observed or updated < desired or total > updated or ready < desired
    summary = f"{ready}/{desired} replicas ready, {updated} up to date"
    if rolling:
        progressing = condition("Progressing", True, "RollingOut", summary)
    else:
        progressing = condition("Progressing", False, "RolloutComplete", summary)

    if desired == 0:
        ready_cond = condition("Ready", False, "ScaledToZero", "spec.replicas is 0")
    elif observed and ready >= desired and updated >= desired:
        ready_cond = condition("Ready", True, "AllReplicasReady", summary)
    else:
        ready_cond = condition("Ready", False, "ReplicasNotReady", summary)
    return [ready_cond, progressing, degraded]


def engine_failure(pods: list[Manifest]) -> Manifest | None:
    """Degraded/EngineFailed for the first pod (by name) whose engine container is not ready
    because it exited with an error (now, or before a restart it is waiting on), with the last
    line of the container's termination message (the log tail: FallbackToLogsOnError); None
    when no engine failed."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", "")):
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            if status.get("name") != ENGINE_CONTAINER or status.get("ready"):
                continue
            state, last = status.get("state") or {}, status.get("lastState") or {}
            exited = state.get("terminated") or (last.get("terminated") if "waiting" in state else None)
            if exited and exited.get("exitCode", 0) != 0:
                lines = [line.strip() for line in (exited.get("message") or "").splitlines() if line.strip()]
                why = lines[-1] if lines else f"exit code {exited.get('exitCode')} ({exited.get('reason', 'Error')})"
                return condition("Degraded", True, "EngineFailed", f"pod {pod['metadata']['name']}: {why}")
    return None


def rollout_complete(deployment: Manifest | None, desired: int) -> bool:
    """The Deployment controller has seen the current template and every pod runs it, available."""
    if deployment is None:
        return False
    status = deployment.get("status", {}) or {}
    if status.get("observedGeneration", 0) < deployment.get("metadata", {}).get("generation", 0):
        return False
    updated = status.get("updatedReplicas", 0) or 0
    return updated >= desired and (status.get("replicas", 0) or 0) <= updated \
        and (status.get("availableReplicas", 0) or 0) >= updated


def engine_status(current: Manifest, desired: Manifest, complete: bool) -> Manifest:
    """status.engine (in force) and status.engineRollingOut (coming); None removes a field."""
    in_force = desired if complete else current.get("engine")
    return {"engine": in_force, "engineRollingOut": None if in_force == desired else desired}


def tuned_placeholder(spec: InferenceServiceSpec, current: list[Manifest]) -> list[Manifest]:
    """The Tuned slot until the autotuner takes it over; an autotuner's own reasons are kept."""
    existing = next((c for c in current if c.get("type") == "Tuned"), None)
    if not spec.autotune.enabled:
        return [condition("Tuned", False, "AutotuneDisabled", "spec.autotune.enabled is false")]
    if existing is None or existing.get("reason") == "AutotuneDisabled":
        return [condition("Tuned", None, "AwaitingMetrics", "no tuning decision yet")]
    return []


def build_status(current: Manifest, generation: int, owner: Owner, spec: InferenceServiceSpec,
                 source: ModelSource, deployment: Manifest | None, now: str,
                 extra_conditions: list[Manifest] | None = None) -> Manifest:
    """The reconciler's part of status (the pilot's fields are added by the controller);
    `extra_conditions`: the conditions the reconcile decided besides the rollout's."""
    dstatus = (deployment or {}).get("status", {}) or {}
    conditions = current.get("conditions", []) or []
    updates = rollout_conditions(deployment, spec.replicas) + tuned_placeholder(spec, conditions) + \
        list(extra_conditions or [])
    engine = engine_status(current, engine_config(owner, spec, source), rollout_complete(deployment, spec.replicas))
    return {
        "observedGeneration": generation,
        "conditions": merge_conditions(conditions, updates, generation, now),
        "replicas": dstatus.get("replicas", 0) or 0,
        "readyReplicas": dstatus.get("readyReplicas", 0) or 0,
        "updatedReplicas": dstatus.get("updatedReplicas", 0) or 0,
        "selector": selector_string(owner),
        "url": service_url(owner),
        **engine,
    }


def invalid_spec_status(current: Manifest, generation: int, message: str, now: str) -> Manifest:
    conditions = current.get("conditions", []) or []
    updates = [condition("Ready", False, "InvalidSpec", message),
               condition("Progressing", False, "InvalidSpec", message),
               condition("Degraded", True, "InvalidSpec", message)]
    return {"observedGeneration": generation,
            "conditions": merge_conditions(conditions, updates, generation, now)}


def api_error_status(current: Manifest, generation: int, message: str, now: str) -> Manifest:
    """Degraded while an API error keeps the operator from applying the spec; the rest of status
    still says what was last observed."""
    conditions = current.get("conditions", []) or []
    update = condition("Degraded", True, "ApiError", message)
    return {"conditions": merge_conditions(conditions, [update], generation, now)}


def status_changes(current: Manifest, new: Manifest) -> Manifest:
    """The keys of `new` whose values differ from `current`: the status patch (a merge patch),
    possibly empty. A None anywhere in `new` removes that key: a field that is gone must be sent
    as None, since a merge patch keeps whatever it does not name, and is then equal to its absence."""
    return {k: v for k, v in new.items() if current.get(k) != _merged(v)}


def _merged(value: Any) -> Any:
    """What a merge patch of `value` leaves stored: keys set to None removed, at every depth."""
    if isinstance(value, dict):
        return {k: _merged(v) for k, v in value.items() if v is not None}
    return value
