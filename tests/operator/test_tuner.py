"""The tuner's step (`plan`, then `settle` on the admin calls' answers) on pods whose windows are
parsed from real metrics pages: a canary an earlier operator left in status is judged on or rolled
back, a canary pod that went away ends the canary, a batch-limit canary is judged only once its pod
runs the target, a pod on other batch limits is brought to the config in force, and what the step
writes into status.tuning is what the CRD keeps."""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune_fixtures import PodMetrics
from crd_admission import openapi_schema

from kvpilot.operator.autoscale.coordination import Coordination
from kvpilot.operator.autotune import (
    CanarySpec,
    EngineLimits,
    Knobs,
    LiveConfig,
    MetricWindow,
    PodEndpoint,
    TuningSpec,
    parse_metrics,
)
from kvpilot.operator.tuner import ChangeResult, TuningInputs, plan, settle
from kvpilot.operator.tuner_state import Canary, TunerState

BEFORE = LiveConfig(16, "recompute", 256, 2048)
WIDER = dataclasses.replace(BEFORE, max_num_seqs=512)  # a batch-limit change
SPEC = TuningSpec(enabled=True, min_dwell_s=60, cooldown_s=0,
                  canary=CanarySpec(window_s=60, timeout_s=300, min_requests=20, tolerance=0.05))
LIMITS = EngineLimits(swap_space_gib=4, max_model_len=2048, enable_chunked_prefill=True)
T0 = 10_000.0  # when the canary started


class Pod:
    """A pod's metrics page and the operator's window of its scrapes."""

    def __init__(self, name: str, config: LiveConfig) -> None:
        self.name, self.metrics = name, PodMetrics(max_num_seqs=config.max_num_seqs)
        self.metrics.configure(config, 1000)
        self.window = MetricWindow(name, 3600)

    def runs(self, config: LiveConfig) -> None:
        self.metrics.configure(config, 1000)

    def scrape(self, time: float, requests: int = 0, waiting: float = 0.0) -> None:
        """`requests` finished since the last scrape, `waiting` queued now."""
        self.metrics.set(waiting=waiting, running=8, kv=0.5)
        self.metrics.serve(requests)
        assert self.window.add(parse_metrics(self.metrics.text(), time))


def inputs(now: float, *pods: Pod) -> TuningInputs:
    latest = {p.name: p.window.latest for p in pods}
    return TuningInputs(now, SPEC, LIMITS, {}, {p.name: p.window for p in pods},
                        {name: s.settings for name, s in latest.items() if s is not None},
                        {p.name: PodEndpoint(p.name, "10.0.0.1", 8000) for p in pods}, Coordination(), dwell_s=60)


def saturated(pods: dict[Pod, int], start: float, end: float) -> None:
    """Every 10 s from `start` to `end`, each pod finishes its count of requests with a queue."""
    time = start
    while time <= end:
        for pod, requests in pods.items():
            pod.scrape(time, requests, waiting=80)
        time += 10


def reloaded(canary_pod: str, target: LiveConfig, previous: LiveConfig | None, tuned: LiveConfig | None) -> TunerState:
    """What a restarted operator reads back from the status an earlier one left mid-canary."""
    status = TunerState(tuned=tuned, canary=Canary(canary_pod, T0, target, previous, "queue depth 120 > 100"))
    return TunerState.from_status(status.to_status(), tuned)


def reasons(events: tuple[Any, ...]) -> list[str]:
    return [e.reason for e in events]


def test_a_reloaded_canary_with_other_pods_is_judged_on_and_promoted() -> None:
    a, b = Pod("a", WIDER), Pod("b", BEFORE)
    saturated({a: 15, b: 10}, T0 + 100, T0 + 200)  # scraped by the new operator only
    state = reloaded("a", WIDER, BEFORE, tuned=BEFORE)
    assert state.canary is not None and state.canary.reloaded
    p = plan(state, inputs(T0 + 200, a, b))
    assert p.action == "promote" and p.changes[0].pod == "b" and p.changes[0].target == WIDER
    assert p.reason.startswith("both at capacity:")
    step = settle(p, [ChangeResult("b", WIDER, before=BEFORE)], inputs(T0 + 200, a, b))
    assert step.state.canary is None and step.state.config == step.state.tuned == WIDER
    assert reasons(step.events) == ["TuningPromoted"] and step.outcome == "promoted"
    assert step.records[0].reason.startswith("promoted from pod a: both at capacity")
    assert step.state.pods == {"a": Knobs.of(WIDER), "b": Knobs.of(WIDER)}


def test_a_reloaded_lone_canary_is_rolled_back_with_an_event_and_a_record() -> None:
    a = Pod("a", WIDER)
    saturated({a: 15}, T0 + 100, T0 + 200)
    state = reloaded("a", WIDER, BEFORE, tuned=None)  # the first change ever: nothing tuned yet
    p = plan(state, inputs(T0 + 200, a))
    assert p.action == "roll_back" and [(c.pod, c.target) for c in p.changes] == [("a", BEFORE)]
    assert "the window before the change, which a lone canary is judged against, was lost" in p.reason
    a.runs(BEFORE)
    step = settle(p, [ChangeResult("a", BEFORE, before=WIDER)], inputs(T0 + 200, a))
    assert step.state.canary is None and step.outcome == "rolled_back"
    assert reasons(step.events) == ["TuningRolledBack"] and step.records[0].reason.startswith("rolled back on pod a")
    assert step.state.condition is not None and step.state.condition["reason"] == "RolledBack"
    # and it stays rolled back: the config in force is the one the canary left, not the target
    # its pod ran when the new operator first looked
    a.scrape(T0 + 210, 15, waiting=80)
    assert step.state.config == BEFORE
    assert plan(step.state, inputs(T0 + 210, a)).action not in ("converge", "canary")


def test_a_canary_pod_that_went_away_ends_the_canary_on_the_previous_config() -> None:
    a, b = Pod("a", WIDER), Pod("b", BEFORE)
    saturated({a: 15, b: 10}, T0 + 10, T0 + 30)
    state = dataclasses.replace(reloaded("a", WIDER, BEFORE, tuned=BEFORE), canary=Canary("a", T0, WIDER, BEFORE, "r"))
    p = plan(state, inputs(T0 + 30, b))  # pod a is no longer Ready
    assert p.action == "lost" and p.changes == ()
    step = settle(p, [], inputs(T0 + 30, b))
    assert step.state.canary is None and step.state.config == BEFORE and step.state.last_change == T0 + 30
    assert reasons(step.events) == ["TuningCanaryLost"]
    assert step.events[0].type == "Warning" and "canary pod a went away" in step.events[0].message
    assert step.state.condition is not None and step.state.condition["reason"] == "CanaryLost"
    (record,) = step.records
    assert (record.before, record.after) == (str(Knobs.of(WIDER)), str(Knobs.of(BEFORE)))
    assert not step.coordination.tuning_in_flight  # the scaler may act again


def test_a_batch_limit_canary_is_judged_only_once_its_pod_runs_the_target() -> None:
    a, b = Pod("a", BEFORE), Pod("b", BEFORE)  # a never took max_num_seqs 512 (restarted since?)
    saturated({a: 15, b: 10}, T0 + 10, T0 + 70)
    state = TunerState(tuned=BEFORE, config=BEFORE, canary=Canary("a", T0, WIDER, BEFORE, "r"))
    p = plan(state, inputs(T0 + 70, a, b))
    assert p.action == "wait" and p.state.condition is not None
    assert "reports max_num_seqs 256 (not 512): not the target" in p.state.condition["message"]
    late = plan(state, inputs(T0 + 300, a, b))  # the timeout: nothing to judge it on
    assert late.action == "roll_back" and "max_num_seqs 256 (not 512)" in late.reason
    a.runs(WIDER)
    saturated({a: 15, b: 10}, T0 + 80, T0 + 140)
    assert plan(state, inputs(T0 + 140, a, b)).action == "promote"


def test_a_pod_on_other_batch_limits_is_brought_to_the_config_in_force() -> None:
    a, b = Pod("a", WIDER), Pod("b", BEFORE)  # b came up with the flags', not the tuned, limits
    saturated({a: 10, b: 10}, T0, T0 + 60)
    state = TunerState(tuned=WIDER, config=WIDER)
    p = plan(state, inputs(T0 + 60, a, b))
    assert p.action == "converge" and [(c.pod, c.target) for c in p.changes] == [("b", WIDER)]
    step = settle(p, [ChangeResult("b", WIDER, before=BEFORE)], inputs(T0 + 60, a, b))
    assert reasons(step.events) == ["TuningConverged"] and step.state.pods["b"] == Knobs.of(WIDER)


def _undeclared(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Paths in `value` the structural schema does not declare: the API server prunes them."""
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema:
            return []
        props = schema.get("properties", {})
        return [p for k, v in value.items()
                for p in ([f"{path}.{k}"] if k not in props else _undeclared(v, props[k], f"{path}.{k}"))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _undeclared(v, schema.get("items", {}), f"{path}[{i}]")]
    return []


def test_what_the_tuner_writes_into_status_is_all_kept_by_the_crd() -> None:
    a, b = Pod("a", WIDER), Pod("b", BEFORE)
    saturated({a: 15, b: 10}, T0 - 200, T0)
    state = TunerState(tuned=BEFORE, config=BEFORE, pods={"a": Knobs.of(WIDER), "b": Knobs.of(BEFORE)},
                       canary=Canary("a", T0, WIDER, BEFORE, "r"), last_change=T0)
    state.outcomes.observe({"b": b.window.summarize()}, SPEC.thresholds)  # type: ignore[dict-item]
    state.outcomes.record_pause(Knobs.of(BEFORE).engine, Knobs.of(WIDER).engine, 0.01)
    status = state.to_status()
    assert status["pods"][0] == {"pod": "a", "blockSize": 16, "preemptionMode": "recompute", "maxNumSeqs": 512,
                                 "maxNumBatchedTokens": 2048}
    assert status["outcomes"][0]["maxNumSeqs"] == 256
    tuning = openapi_schema()["properties"]["status"]["properties"]["tuning"]
    assert _undeclared(status, tuning, "status.tuning") == []
