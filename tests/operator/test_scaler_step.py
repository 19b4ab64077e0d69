"""The autoscaler's step as a function: windows, replicas and coordination in; the state, the
scale write, the Events and the records out (the pilot applies them)."""

from __future__ import annotations

import dataclasses

from autotune_fixtures import summary

from kvpilot.operator.autoscale import Coordination, ScalingSpec
from kvpilot.operator.autoscale.scaling_spec import SCALE_DOWN, Behavior
from kvpilot.operator.scaler import ScalingInputs, ScalingState, scale, watch_target

SPEC = ScalingSpec(enabled=True, metric="kvCacheUsage", target=0.5, max_replicas=8, interval_s=15, window_s=60,
                   behavior=Behavior(scale_down=dataclasses.replace(SCALE_DOWN, stabilization_window_s=0)))


def inputs(kv: float, waiting: float = 0.0, replicas: int = 2, coordination: Coordination | None = None,
           now: float = 1000.0) -> ScalingInputs:
    pods = {p: dataclasses.replace(summary(p), kv_cache_usage=kv, num_waiting_seqs=waiting,
                                  num_requests_waiting=waiting) for p in ("a", "b")}
    return ScalingInputs(now, SPEC, replicas, pods, {p: "ready" for p in pods}, coordination or Coordination(),
                         dwell_s=60)


def test_a_scale_up_is_a_write_an_event_and_a_record_and_marks_the_coordination() -> None:
    step = scale(ScalingState(), inputs(kv=0.9))  # 1.8 times the target on 2 replicas
    assert (step.scale_to, step.direction) == (4, "up")
    assert step.state.desired == 4 and step.state.last_scale == 1000.0
    assert step.state.condition is not None and step.state.condition["status"] == "True"
    assert [e.reason for e in step.events] == ["Scaled"]
    assert [(r.kind, r.before, r.after) for r in step.records] == [("scale", "2", "4")]
    assert step.coordination.last_scale == 1000.0
    assert step.state.to_status() == {"desiredReplicas": 4, "lastScaleTime": "1970-01-01T00:16:40Z", "value": 0.9}
    assert ScalingState.from_status(step.state.to_status()).last_scale == 1000.0


def test_a_scale_down_waits_while_a_tuning_change_is_judged() -> None:
    held = Coordination().tuning_started()
    step = scale(ScalingState(desired=2), inputs(kv=0.05, coordination=held, now=2000.0))
    assert step.scale_to is None and step.records == () and step.events == ()
    assert step.state.desired == 2 and step.coordination == held
    assert step.state.condition is not None and step.state.condition["reason"] == "WaitingForTuning"
    free = scale(ScalingState(desired=2), inputs(kv=0.05, now=2000.0))
    assert (free.scale_to, free.direction) == (1, "down")


def test_a_target_out_of_reach_is_an_event_once_as_it_begins() -> None:
    queueing = inputs(kv=0.05, waiting=20)
    first = watch_target(ScalingState(), queueing)
    assert [e.reason for e in first.events] == ["ScalingTargetUnreachable"] and first.state.unreachable
    assert watch_target(first.state, queueing).events == ()
    assert watch_target(first.state, inputs(kv=0.05)).state.unreachable is None
