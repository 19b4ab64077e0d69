from __future__ import annotations

from typing import Any

from kvpilot.operator.manifests import Owner
from kvpilot.operator.model_source import resolve_model_source
from kvpilot.operator.spec import InferenceServiceSpec
from kvpilot.operator.status import (
    api_error_status,
    build_status,
    engine_failure,
    invalid_spec_status,
    merge_conditions,
    rollout_complete,
    rollout_conditions,
    status_changes,
)

OWNER = Owner("llama", "default", "uid")


def _deployment(ready: int, updated: int, total: int, generation: int = 1, observed: int = 1,
                conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "readyReplicas": ready, "updatedReplicas": updated,
                       "availableReplicas": ready, "replicas": total, "conditions": conditions or []}}


def _by_type(conditions: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in conditions}


def test_all_replicas_ready_is_ready_and_not_progressing() -> None:
    got = _by_type(rollout_conditions(_deployment(2, 2, 2), desired=2))
    assert got == {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "RolloutComplete"),
                   "Degraded": ("False", "AsExpected")}


def test_rollout_in_progress() -> None:
    got = _by_type(rollout_conditions(_deployment(2, 1, 3, generation=2, observed=2), desired=2))
    assert got["Progressing"] == ("True", "RollingOut")
    assert got["Ready"] == ("False", "ReplicasNotReady")


def test_unobserved_generation_is_progressing() -> None:
    got = _by_type(rollout_conditions(_deployment(1, 1, 1, generation=2, observed=1), desired=1))
    assert got["Progressing"][0] == "True"


def test_progress_deadline_is_degraded() -> None:
    stuck = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "slow"}]
    got = _by_type(rollout_conditions(_deployment(0, 1, 1, conditions=stuck), desired=1))
    assert got["Degraded"] == ("True", "ProgressDeadlineExceeded")


def test_scaled_to_zero_is_not_ready() -> None:
    assert _by_type(rollout_conditions(_deployment(0, 0, 0), desired=0))["Ready"] == ("False", "ScaledToZero")


def test_transition_time_moves_only_when_status_flips() -> None:
    first = merge_conditions([], [{"type": "Ready", "status": "False", "reason": "a", "message": ""}], 1, "t1")
    same = merge_conditions(first, [{"type": "Ready", "status": "False", "reason": "b", "message": ""}], 2, "t2")
    flipped = merge_conditions(same, [{"type": "Ready", "status": "True", "reason": "c", "message": ""}], 2, "t3")
    assert [c["lastTransitionTime"] for c in (first[0], same[0], flipped[0])] == ["t1", "t1", "t3"]
    assert same[0]["observedGeneration"] == 2


def test_status_carries_selector_url_engine_and_tuned_slot() -> None:
    spec = InferenceServiceSpec.model_validate({"model": {"source": "pvc://m/llama"}, "replicas": 2,
                                                "engine": {"blockSize": 32}})
    status = build_status({}, 3, OWNER, spec, resolve_model_source("pvc://m/llama"), _deployment(2, 2, 2), "t")
    assert status["observedGeneration"] == 3
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert status["url"] == "http://llama.default.svc:8000"
    assert status["selector"].startswith("app.kubernetes.io/name=kvpilot")
    assert status["engine"]["blockSize"] == 32 and status["engine"]["model"] == "/models/llama"
    assert _by_type(status["conditions"])["Tuned"] == ("False", "AutotuneDisabled")


def test_recomputing_an_unchanged_status_changes_nothing() -> None:
    spec = InferenceServiceSpec.model_validate({"model": {"source": "embedded"}})
    source = resolve_model_source("embedded")
    first = build_status({}, 1, OWNER, spec, source, _deployment(1, 1, 1), "t1")
    again = build_status(first, 1, OWNER, spec, source, _deployment(1, 1, 1), "t2")
    assert status_changes(first, again) == {}


def test_a_nested_field_that_is_gone_is_sent_as_null_and_then_equals_its_absence() -> None:
    """A merge patch keeps what it does not name: a canary that ended must be sent as null, or
    status shows it for ever; once removed, the same null is no change."""
    stored = {"tuning": {"pods": [], "canary": {"pod": "smol-a"}}}
    changes = status_changes(stored, {"tuning": {"pods": [], "canary": None}})
    assert changes == {"tuning": {"pods": [], "canary": None}}
    assert status_changes({"tuning": {"pods": []}}, {"tuning": {"pods": [], "canary": None}}) == {}


def test_invalid_spec_is_degraded() -> None:
    status = invalid_spec_status({}, 4, "bad source", "t")
    assert _by_type(status["conditions"])["Degraded"] == ("True", "InvalidSpec")
    assert status["observedGeneration"] == 4


def _spec(block_size: int, replicas: int = 2) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({"model": {"source": "embedded"}, "replicas": replicas,
                                                "engine": {"blockSize": block_size}})


def _status(current: dict[str, Any], spec: InferenceServiceSpec, deployment: dict[str, Any]) -> dict[str, Any]:
    return build_status(current, 2, OWNER, spec, resolve_model_source("embedded"), deployment, "t")


def test_the_engine_in_force_moves_only_when_every_pod_runs_the_new_one() -> None:
    """The BLOCK column reads status.engine: it must not show 32 while pods with 16 still serve."""
    settled = _status({}, _spec(16), _deployment(2, 2, 2))
    assert settled["engine"]["blockSize"] == 16 and settled["engineRollingOut"] is None

    midway = _status(settled, _spec(32), _deployment(2, 1, 3, generation=2, observed=2))
    assert midway["engine"]["blockSize"] == 16
    assert midway["engineRollingOut"]["blockSize"] == 32

    unseen = _status(settled, _spec(32), _deployment(2, 2, 2, generation=2, observed=1))
    assert unseen["engine"]["blockSize"] == 16  # the controller has not even seen the new template

    done = _status(midway, _spec(32), _deployment(2, 2, 2, generation=2, observed=2))
    assert done["engine"]["blockSize"] == 32 and done["engineRollingOut"] is None
    changes = status_changes(midway, done)  # the patch removes engineRollingOut (a null in a merge patch)
    assert changes["engine"]["blockSize"] == 32 and "engineRollingOut" in changes and changes["engineRollingOut"] is None


def test_no_engine_is_in_force_before_a_first_pod_is_available() -> None:
    status = _status({}, _spec(16), _deployment(0, 2, 2))
    assert status["engine"] is None and status["engineRollingOut"]["blockSize"] == 16


def test_rollout_complete_needs_every_pod_updated_and_available() -> None:
    assert rollout_complete(_deployment(2, 2, 2), 2)
    assert not rollout_complete(_deployment(1, 2, 2), 2)  # one not available yet
    assert not rollout_complete(_deployment(2, 2, 3), 2)  # an old pod still terminating
    assert not rollout_complete(None, 1)


def test_a_persistent_api_error_is_degraded_and_keeps_the_rest() -> None:
    current = {"conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": ""}]}
    status = api_error_status(current, 3, "403 Forbidden: deployments.apps is forbidden", "t")
    assert _by_type(status["conditions"]) == {"Ready": ("True", "AllReplicasReady"), "Degraded": ("True", "ApiError")}


MISMATCH = ("INFO kvpilot: loading\nkvpilot serve: error: --quantization: fp8 does not match the checkpoint's "
            "quantization_config (awq, in /models/m); pass --quantization awq or auto\n")


def _pod(name: str, ready: bool, state: dict[str, Any], last: dict[str, Any] | None = None,
         container: str = "server") -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"containerStatuses": [
        {"name": container, "ready": ready, "restartCount": 1, "state": state, "lastState": last or {}}]}}


def test_an_engine_that_exits_with_an_error_is_degraded_with_its_last_line() -> None:
    crashed = {"terminated": {"exitCode": 2, "reason": "Error", "message": MISMATCH}}
    for pod in (_pod("llama-b", False, crashed), _pod("llama-b", False, {"waiting": {"reason": "CrashLoopBackOff"}}, crashed)):
        got = engine_failure([_pod("llama-c", False, {"waiting": {"reason": "ContainerCreating"}}), pod])
        assert got is not None and (got["type"], got["status"], got["reason"]) == ("Degraded", "True", "EngineFailed")
        assert got["message"] == ("pod llama-b: kvpilot serve: error: --quantization: fp8 does not match the "
                                  "checkpoint's quantization_config (awq, in /models/m); pass --quantization awq or auto")
    without_message = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    assert engine_failure([_pod("p", False, without_message)])["message"] == "pod p: exit code 137 (OOMKilled)"  # type: ignore[index]


def test_running_restarted_starting_or_other_containers_are_no_engine_failure() -> None:
    crashed = {"terminated": {"exitCode": 2, "message": MISMATCH}}
    assert engine_failure([]) is None
    assert engine_failure([_pod("p", True, {"running": {}}, crashed)]) is None  # recovered since
    assert engine_failure([_pod("p", False, {"running": {}}, crashed)]) is None  # starting again, not ready yet
    assert engine_failure([_pod("p", False, {"terminated": {"exitCode": 0}})]) is None
    assert engine_failure([_pod("p", False, crashed, container="sidecar")]) is None
