"""The builtin autoscaler's decision on synthetic windows: the HPA's ratio and tolerance, missing
and starting pods, stabilisation, rate limits, bounds, and flapping traffic that does not flap
the replicas."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import pytest
from autotune_fixtures import summary

from kvpilot.operator.autoscale import (
    Behavior,
    PodState,
    ScaleDecision,
    ScalerState,
    ScalingPolicy,
    ScalingRules,
    ScalingSpec,
    decide_replicas,
)
from kvpilot.operator.autoscale.policy import out_of_reach
from kvpilot.operator.autotune import WindowSummary

WAITING = ScalingSpec(enabled=True, metric="waitingPerReplica", target=4, max_replicas=20)
FRESH = ScalerState()
NO_STABILISATION = Behavior(scale_down=ScalingRules(0, (ScalingPolicy("Percent", 100, 15),)))


def run(*windows: WindowSummary, current: int | None = None, spec: ScalingSpec = WAITING,
        state: ScalerState = FRESH, now: float = 1000.0, starting: Iterable[str] = (),
        missing: Iterable[str] = (), leaving: Iterable[str] = ()) -> ScaleDecision:
    pods: dict[str, PodState] = {s.pod: "ready" for s in windows}
    pods |= {p: "ready" for p in missing} | {p: "starting" for p in starting} | {p: "leaving" for p in leaving}
    replicas = current if current is not None else sum(1 for s in pods.values() if s != "leaving")
    return decide_replicas({s.pod: s for s in windows}, pods, replicas, spec, state, now=now)


BASE = summary()


def waiting(*values: float) -> list[WindowSummary]:
    return [dataclasses.replace(BASE, pod=f"pod-{i}", num_requests_waiting=v) for i, v in enumerate(values)]


def test_a_ratio_within_the_tolerance_changes_nothing() -> None:
    d = run(*waiting(4.3, 4.3))
    assert d.desired == 2 and d.direction is None and d.code == "DesiredWithinRange"
    assert d.reason == ("waitingPerReplica 4.3 (mean of 2 ready pods) vs target 4.0: ratio 1.07, "
                        "within tolerance 0.1: 2 replicas stay")


def test_replicas_follow_the_ratio_of_the_per_pod_mean_to_the_target() -> None:
    d = run(*waiting(16.0, 8.0))
    assert (d.current, d.desired, d.direction, d.value) == (2, 6, "up", 12.0)
    assert d.reason == "waitingPerReplica 12.0 (mean of 2 ready pods) vs target 4.0: ratio 3.00 asks for 6: 2 -> 6 replicas"


def test_kv_cache_usage_above_the_articles_85_percent_scales_out() -> None:
    spec = ScalingSpec(enabled=True, metric="kvCacheUsage", target=0.85, max_replicas=10)
    kv = [dataclasses.replace(BASE, pod=f"pod-{i}", kv_cache_usage=u) for i, u in enumerate((0.95, 0.96, 0.94, 0.95))]
    assert run(*kv, spec=spec).desired == 5
    # 0.93 is above 0.85 but within the HPA's 10% tolerance
    assert run(*[dataclasses.replace(s, kv_cache_usage=0.93) for s in kv], spec=spec).desired == 4


def test_a_ready_pod_without_a_window_counts_as_idle_when_scaling_up() -> None:
    # without pod-1 the mean is 12 (ratio 3, 6 replicas); with it assumed at 0, ratio 1.5
    d = run(*waiting(12.0), missing=["pod-1"])
    assert d.desired == 3 and "1 pod without a window assumed at 0" in d.reason


def test_a_ready_pod_without_a_window_counts_at_the_target_when_scaling_down() -> None:
    spec = dataclasses.replace(WAITING, behavior=NO_STABILISATION)
    d = run(*waiting(0.0, 0.0, 0.0), missing=["pod-3"], spec=spec)
    assert d.desired == 1 and "assumed at 4" in d.reason  # mean 1: ratio 0.25 of 4 pods


def test_starting_pods_count_as_idle_so_a_scale_up_is_not_repeated_while_they_load() -> None:
    d = run(*waiting(8.0, 8.0), starting=["pod-2", "pod-3"])
    assert d.desired == 4 and "2 starting pods assumed at 0" in d.reason  # ratio 2 -> 1
    more = run(*waiting(16.0, 16.0), starting=["pod-2", "pod-3"])
    assert more.desired == 8


def test_starting_pods_are_left_out_of_a_scale_down() -> None:
    spec = dataclasses.replace(WAITING, behavior=NO_STABILISATION)
    d = run(*waiting(1.0, 1.0), starting=["pod-2"], spec=spec)
    assert d.desired == 1  # ceil(0.25 * 2 ready pods); the starting one goes first


def test_leaving_pods_are_ignored() -> None:
    d = run(*waiting(4.0, 4.0), current=2, leaving=["pod-9"])
    assert d.desired == 2 and "mean of 2 ready pods" in d.reason


def test_no_window_at_all_holds_the_replicas() -> None:
    d = run(current=3, missing=["a", "b"], starting=["c"])
    assert d.desired == 3 and d.code == "NoMetrics" and d.value is None
    assert "no ready pod has a window yet (2 ready, 1 starting)" in d.reason


def test_ttft_p99_comes_from_the_merged_histograms_of_the_service() -> None:
    spec = ScalingSpec(enabled=True, metric="ttftP99", target=1.0, max_replicas=10)
    d = run(summary("a", ttft=2.0), summary("b", ttft=0.05, requests=1), spec=spec)
    # 200 of 201 requests in the (1, 2.5] bucket: P99 interpolates to 2.485 s
    assert d.value == pytest.approx(1 + 1.5 * (0.99 * 201 - 1) / 200) and d.desired == 5
    assert "merged over 2 ready pods" in d.reason


def test_an_idle_service_reads_as_zero_latency_and_can_scale_down() -> None:
    spec = ScalingSpec(enabled=True, metric="ttftP99", target=1.0, max_replicas=10, behavior=NO_STABILISATION)
    idle = [summary(p, requests=0, num_running_seqs=0.0, num_requests_waiting=0.0) for p in ("a", "b", "c")]
    d = run(*idle, spec=spec)
    assert (d.value, d.desired) == (0.0, 1) and "idle" in d.reason
    busy = [dataclasses.replace(s, num_running_seqs=3.0) for s in idle]
    held = run(*busy, spec=spec)
    assert held.desired == 3 and held.code == "NoMetrics"


def test_scale_down_waits_for_the_stabilization_window() -> None:
    state, current, replicas_seen = ScalerState(), 4, []
    for t in range(0, 331, 15):
        d = run(*waiting(*([4.0] * current if t == 0 else [0.4] * current)), state=state, now=1000.0 + t)
        state = d.scaled_state if d.desired != d.current else d.state
        current = d.desired
        replicas_seen.append((t, current))
    # the estimate at t=0 asked for 4; the 300 s window holds estimates after now - 300
    assert [t for t, r in replicas_seen if r == 4] == list(range(0, 300, 15))
    assert replicas_seen[-3:] == [(300, 1), (315, 1), (330, 1)]


def test_the_held_decision_says_why() -> None:
    state = run(*waiting(4.0, 4.0, 4.0, 4.0), now=1000.0).state
    d = run(*waiting(0.4, 0.4, 0.4, 0.4), state=state, now=1015.0)
    assert d.desired == 4 and d.code == "ScaleDownStabilized"
    assert "asks for 1; held at 4, the highest estimate within the scaleDown stabilization window (300 s)" in d.reason


def test_a_fresh_state_never_scales_down_at_once() -> None:
    # after an operator restart the state is empty: the replicas in force are the first estimate
    d = run(*waiting(0.0, 0.0, 0.0))
    assert d.desired == 3 and d.code == "ScaleDownStabilized"


def test_scale_up_is_limited_by_the_default_policies_per_period() -> None:
    d = run(*waiting(40.0, 40.0))  # asks for 20
    assert (d.desired, d.code) == (6, "ScaleUpLimit")  # max(100% of 2, 2 + 4 pods)
    assert "limited to 6 by the scaleUp policies" in d.reason
    state = d.scaled_state
    # 10 s later the period still counts the 4 pods added: 6 - 4 = 2 at its start
    again = run(*waiting(40.0, 40.0), starting=[f"new-{i}" for i in range(4)], state=state, now=1010.0)
    assert again.desired == 6
    later = run(*waiting(*[40.0] * 6), state=state, now=1016.0)
    assert later.desired == 12


def test_select_policy_min_takes_the_smaller_step_and_disabled_none() -> None:
    slow = Behavior(scale_up=ScalingRules(0, (ScalingPolicy("Percent", 100, 15), ScalingPolicy("Pods", 1, 60)), "Min"))
    assert run(*waiting(40.0, 40.0), spec=dataclasses.replace(WAITING, behavior=slow)).desired == 3
    frozen = Behavior(scale_up=ScalingRules(0, (ScalingPolicy("Pods", 4, 15),), "Disabled"))
    d = run(*waiting(40.0, 40.0), spec=dataclasses.replace(WAITING, behavior=frozen))
    assert d.desired == 2


def test_percent_scale_down_rounds_down_per_period() -> None:
    half = Behavior(scale_down=ScalingRules(0, (ScalingPolicy("Percent", 50, 60),)))
    spec = dataclasses.replace(WAITING, behavior=half)
    d = run(*waiting(*[0.0] * 9), spec=spec)
    assert (d.desired, d.code) == (4, "ScaleDownLimit")  # floor(9 * 0.5)
    again = run(*waiting(*[0.0] * 4), spec=spec, state=d.scaled_state, now=1030.0)
    assert again.desired == 4  # the period started at 9; 4 is already half of it
    assert run(*waiting(*[0.0] * 4), spec=spec, state=d.scaled_state, now=1061.0).desired == 2


def test_bounds() -> None:
    spec = dataclasses.replace(WAITING, max_replicas=5, min_replicas=2, behavior=NO_STABILISATION)
    up = run(*waiting(40.0, 40.0, 40.0, 40.0), spec=spec)
    assert (up.desired, up.code) == (5, "TooManyReplicas")
    down = run(*waiting(0.0, 0.0, 0.0), spec=spec)
    assert (down.desired, down.code) == (2, "TooFewReplicas")
    assert run(*waiting(4.0), current=7, spec=spec).desired == 5
    assert run(*waiting(4.0), current=1, spec=spec).desired == 2


def test_replicas_scaled_to_zero_by_hand_are_left_alone() -> None:
    d = run(current=0)
    assert d.desired == 0 and d.code == "ScalingDisabled"


def test_flapping_traffic_does_not_flap_the_replicas() -> None:
    """Load that swings between 3x and 0.3x the target every minute for an hour: the fleet goes up
    once and stays, instead of following each swing."""
    state, current, changes = ScalerState(), 2, []
    for step in range(240):
        now = 1000.0 + 15 * step
        per_pod = 12.0 * 2 / current if (step // 4) % 2 == 0 else 1.2 * 2 / current
        d = run(*waiting(*[per_pod] * current), state=state, now=now)
        if d.desired != current:
            changes.append((step, current, d.desired))
            state = d.scaled_state
        else:
            state = d.state
        current = d.desired
    assert changes == [(0, 2, 6)]


def test_the_state_stays_bounded() -> None:
    state, current = ScalerState(), 2
    for step in range(2000):
        d = run(*waiting(*[4.0 + (step % 3)] * current), state=state, now=1000.0 + 15 * step)
        state, current = (d.scaled_state if d.desired != current else d.state), d.desired
    assert len(state.recommendations) <= 300 // 15 + 1
    assert len(state.scale_ups) <= 1 and len(state.scale_downs) <= 1


@pytest.mark.parametrize(("fields", "message"), [
    ({"min_replicas": 0}, "min_replicas: must be >= 1"),
    ({"min_replicas": 3, "max_replicas": 2}, "max_replicas: must be >= min_replicas (3)"),
    ({"metric": "kvCacheUsage", "target": 85}, "target: kvCacheUsage is a fraction"),
    ({"metric": "cpu"}, "metric: must be one of"),
    ({"target": 0}, "target: must be positive"),
    ({"tolerance": 1.0}, "tolerance: must lie in [0, 1)"),
    ({"mode": "hpa", "window_s": 30}, "window_s: mode hpa takes it from the cluster"),
    ({"mode": "hpa", "interval_s": 30}, "interval_s: mode hpa takes it from the cluster"),
    ({"prometheus_address": "http://prom:9090"}, "prometheus_address: only mode keda reads it"),
    ({"mode": "keda", "prometheus_address": "prom:9090"}, "prometheus_address: must be an http(s) URL"),
])
def test_bad_specs_name_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ScalingSpec(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("make", "message"), [
    (lambda: ScalingPolicy("Replicas", 1, 15), "type: must be Pods or Percent"),  # type: ignore[arg-type]
    (lambda: ScalingPolicy("Pods", 0, 15), "value: must be >= 1"),
    (lambda: ScalingPolicy("Pods", 1, 3600), "period_s: must lie in [1, 1800]"),
    (lambda: ScalingRules(0, ()), "policies: at least one is needed"),
    (lambda: ScalingRules(4000, (ScalingPolicy("Pods", 1, 15),)), "stabilization_window_s: must lie in [0, 3600]"),
])
def test_bad_behavior_names_the_field(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        make()  # type: ignore[operator]


KV = ScalingSpec(enabled=True, metric="kvCacheUsage", target=0.85, max_replicas=10)


def pods_with(kv: float, queue: float, n: int = 2) -> dict[str, WindowSummary]:
    return {f"pod-{i}": dataclasses.replace(BASE, pod=f"pod-{i}", kv_cache_usage=kv, num_requests_waiting=queue)
            for i in range(n)}


def test_a_kv_target_the_pods_stay_below_while_requests_queue_is_out_of_reach() -> None:
    windows = pods_with(0.07, 12.0)
    ready: dict[str, PodState] = dict.fromkeys(windows, "ready")
    why = out_of_reach(windows, ready, KV)
    assert why is not None and why.startswith(
        "kvCacheUsage target 0.85 is out of the pods' reach: 0.07 while 12.0 requests wait per pod")
    assert run(*windows.values(), spec=KV).desired == 2  # the HPA's rule alone scales nothing


@pytest.mark.parametrize(("kv", "queue", "spec", "states"), [
    (0.07, 0.5, KV, "ready"),  # no queue: a light load, not an unreachable target
    (0.80, 12.0, KV, "ready"),  # within the tolerance of 0.85: the queue will scale it
    (0.07, 12.0, WAITING, "ready"),  # the queue is the signal: it grows with the queue
    (0.07, 12.0, dataclasses.replace(KV, metric="ttftP99", target=1.0), "ready"),
    (0.07, 12.0, KV, "starting"),  # no ready pod: nothing to judge
])
def test_a_target_is_not_called_out_of_reach_when(kv: float, queue: float, spec: ScalingSpec, states: PodState) -> None:
    windows = pods_with(kv, queue)
    assert out_of_reach(windows, dict.fromkeys(windows, states), spec) is None


def test_preemptions_the_queueing_pods_never_reach_are_out_of_reach_too() -> None:
    spec = ScalingSpec(enabled=True, metric="preemptionRate", target=1.0, max_replicas=10)
    windows = {p: dataclasses.replace(s, preemptions_per_s=0.0) for p, s in pods_with(0.3, 5.0).items()}
    assert "preemptionRate target 1.00/s is out of the pods' reach: 0.00/s" in (
        out_of_reach(windows, dict.fromkeys(windows, "ready"), spec) or "")


def test_a_queueing_service_below_an_unreachable_target_is_not_scaled_down() -> None:
    spec = dataclasses.replace(KV, behavior=NO_STABILISATION)
    d = run(*pods_with(0.07, 12.0, n=4).values(), spec=spec)
    assert (d.desired, d.direction, d.code) == (4, None, "TargetUnreachable")
    assert d.reason.endswith("asks for 1: 4 replicas stay (no scale-down while requests queue)")
    # the same windows without a queue: a light load, scaled down as the HPA would
    calm = run(*pods_with(0.07, 0.2, n=4).values(), spec=spec)
    assert (calm.desired, calm.code) == (1, "DesiredWithinRange")
