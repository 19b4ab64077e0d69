"""The canary judgement: promote, roll back, or wait for enough data, with the numbers recorded."""

from __future__ import annotations

import dataclasses

from autotune_fixtures import summary

from kvpilot.operator.autotune import CanarySpec, LiveConfig, SloTargets, TuningSpec, judge

TARGET = LiveConfig(8, "swap", 256, 2048)
SPEC = TuningSpec(enabled=True, canary=CanarySpec(window_s=300, timeout_s=900, min_requests=100, tolerance=0.05))


def canary(requests: int = 200, ttft: float = 0.05, itl: float = 0.02):  # type: ignore[no-untyped-def]
    return summary("canary", duration_s=300.0, block_size=8, mode="swap", requests=requests, ttft=ttft, itl=itl)


def others(n: int = 2, requests: int = 200, ttft: float = 0.05, itl: float = 0.02):  # type: ignore[no-untyped-def]
    return [summary(f"pod-{i}", duration_s=300.0, requests=requests, ttft=ttft, itl=itl) for i in range(n)]


def test_a_canary_as_good_as_the_others_is_promoted_with_its_numbers() -> None:
    j = judge(canary(), others(), TARGET, SPEC, elapsed_s=300)
    assert j.verdict == "promote"
    assert j.reason.startswith("goodput 0.667/s vs 0.667/s; P99 TTFT 0.060 s vs 0.060 s; P99 ITL 0.020 s vs 0.020 s")
    assert j.canary is not None and j.baseline is not None and j.baseline.num_pods == 2


def test_lower_goodput_rolls_back() -> None:
    j = judge(canary(requests=150), others(), TARGET, SPEC, elapsed_s=300)
    assert j.verdict == "rollback"
    assert j.reason == "goodput 0.500/s vs 0.667/s: lower by more than 5%"


def test_a_higher_p99_without_a_goodput_gain_rolls_back() -> None:
    j = judge(canary(ttft=0.5), others(), TARGET, SPEC, elapsed_s=300)
    assert j.verdict == "rollback"
    assert "P99 TTFT 0.497 s vs 0.060 s: higher by more than 5% with no goodput gain" in j.reason


def test_a_higher_p99_is_accepted_for_a_goodput_gain() -> None:
    assert judge(canary(requests=300, itl=0.05), others(), TARGET, SPEC, elapsed_s=300).verdict == "promote"


def test_goodput_counts_only_requests_within_the_ttft_target() -> None:
    spec = dataclasses.replace(SPEC, slo=SloTargets(ttft_p99_s=1.0))
    j = judge(canary(requests=300, ttft=2.0), others(), TARGET, spec, elapsed_s=300)
    assert j.verdict == "rollback" and j.reason.startswith("goodput 0.000/s vs 0.667/s")


def test_the_others_are_compared_per_pod() -> None:
    assert judge(canary(), others(n=5), TARGET, SPEC, elapsed_s=300).verdict == "promote"


def test_a_lone_replica_is_compared_with_its_own_window_before_the_change() -> None:
    before = summary("canary", duration_s=300.0, block_size=16, mode="recompute", requests=200, ttft=0.5)
    j = judge(canary(ttft=0.05), [before], TARGET, SPEC, elapsed_s=400)
    assert j.verdict == "promote" and "P99 TTFT 0.060 s vs 0.497 s" in j.reason


def test_too_few_requests_wait_and_then_roll_back_at_the_timeout() -> None:
    waiting = judge(canary(requests=20), others(), TARGET, SPEC, elapsed_s=600)
    assert waiting.verdict == "wait"
    assert waiting.reason == "not enough requests: canary 20, baseline 400, 100 needed on each side"
    late = judge(canary(requests=20), others(), TARGET, SPEC, elapsed_s=900)
    assert late.verdict == "rollback" and late.reason.startswith("inconclusive at the canary timeout: not enough")


def test_nothing_is_decided_before_the_canary_window_ends() -> None:
    j = judge(canary(requests=10_000), others(), TARGET, SPEC, elapsed_s=120)
    assert j.verdict == "wait" and j.reason == "canary window: 120 of 300 s"


def test_a_canary_pod_not_running_the_target_is_not_judged() -> None:
    stale = summary("canary", duration_s=300.0, requests=200)  # back on 16, recompute: restarted?
    j = judge(stale, others(), TARGET, SPEC, elapsed_s=300)
    assert j.verdict == "wait" and "reports block_size 16, recompute, not the target's 8, swap" in j.reason
    assert judge(stale, others(), TARGET, SPEC, elapsed_s=900).verdict == "rollback"


def test_a_canary_without_a_window_waits() -> None:
    assert judge(None, others(), TARGET, SPEC, elapsed_s=300).reason == "no window yet for the canary pod"
    assert judge(canary(), [], TARGET, SPEC, elapsed_s=300).reason == "no window yet for the baseline"
