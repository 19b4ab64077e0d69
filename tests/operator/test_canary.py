"""The canary judgement on synthetic windows: promote, roll back, or wait, on load-normalised
figures only. A change of load or of request mix during the canary, or an uneven spread of
requests over the pods, promotes nothing (raw goodput, which follows the load, and tokens/s,
which follows the mix, would have); a real gain is promoted."""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune_fixtures import LENGTH_BUCKETS, histogram, summary

from kvpilot.operator.autotune import (
    CanarySpec,
    LiveConfig,
    SloTargets,
    TuningSpec,
    WindowSummary,
    judge,
)

TARGET = LiveConfig(8, "swap", 256, 2048)
SPEC = TuningSpec(enabled=True, canary=CanarySpec(window_s=300, timeout_s=900, min_requests=100, tolerance=0.05))
BUSY = {"num_waiting_seqs": 80.0}  # requests queue: the pod runs at capacity


def canary(requests: int = 200, ttft: float = 0.05, itl: float = 0.02, **fields: float):  # type: ignore[no-untyped-def]
    return summary("canary", duration_s=300.0, block_size=8, mode="swap", requests=requests, ttft=ttft, itl=itl,
                   **fields)


def others(n: int = 2, requests: int = 200, ttft: float = 0.05, itl: float = 0.02, **fields: float):  # type: ignore[no-untyped-def]
    return [summary(f"pod-{i}", duration_s=300.0, requests=requests, ttft=ttft, itl=itl, **fields) for i in range(n)]


def before(requests: int = 200, ttft: float = 0.05, **fields: float):  # type: ignore[no-untyped-def]
    """A lone replica's own window before the change."""
    return [summary("canary", duration_s=300.0, block_size=16, mode="recompute", requests=requests, ttft=ttft,
                    **fields)]


def test_a_canary_as_good_as_the_others_at_the_same_load_is_promoted_with_its_numbers() -> None:
    j = judge(canary(), others(), TARGET, SPEC, elapsed_s=300)
    assert j.verdict == "promote"
    assert j.reason == ("SLO met by 100.0% vs 100.0% of requests (0.667 vs 0.667 requests/s per pod); "
                        "P99 TTFT 0.060 s vs 0.060 s; P99 ITL 0.020 s vs 0.020 s")
    assert j.canary is not None and j.baseline is not None and j.baseline.num_pods == 2


def test_a_higher_p99_at_the_same_load_rolls_back() -> None:
    j = judge(canary(ttft=0.5), others(), TARGET, SPEC, elapsed_s=300)
    assert j.verdict == "rollback"
    assert j.reason.startswith("P99 TTFT 0.497 s vs 0.060 s: higher by more than 5% with no gain in the SLO share")


def test_a_lower_slo_share_rolls_back() -> None:
    spec = dataclasses.replace(SPEC, slo=SloTargets(ttft_p99_s=1.0))
    j = judge(canary(ttft=2.0), others(), TARGET, spec, elapsed_s=300)
    assert j.verdict == "rollback" and j.reason.startswith("SLO met by 0.0% vs 100.0% of requests")


def test_an_uneven_spread_of_requests_over_the_pods_promotes_nothing() -> None:
    """The Service sent the canary twice its share: twice the goodput per pod (what the old rule
    promoted on), the same config, nothing to conclude; at the timeout it rolls back."""
    j = judge(canary(requests=400), others(), TARGET, SPEC, elapsed_s=300)
    assert j.verdict == "wait"
    assert j.reason == "offered loads differ by more than 20% (1.333 vs 0.667 requests/s per pod): nothing compares"
    assert judge(canary(requests=400), others(), TARGET, SPEC, elapsed_s=900).verdict == "rollback"


def test_a_burst_ending_during_a_lone_canary_promotes_nothing() -> None:
    """Before the change the replica was swamped (a queue, SLO missed), after it the burst is
    over: every figure looks better, and none of it is the config's doing."""
    spec = dataclasses.replace(SPEC, slo=SloTargets(ttft_p99_s=1.0))
    swamped = before(requests=900, ttft=4.0, **BUSY)
    j = judge(canary(requests=200, ttft=0.05), swamped, TARGET, spec, elapsed_s=400)
    assert j.verdict == "wait" and j.reason.startswith("only the baseline ran at capacity")
    # and a burst starting on the canary blames it for nothing either
    j = judge(canary(requests=900, ttft=4.0, **BUSY), before(), TARGET, spec, elapsed_s=400)
    assert j.verdict == "wait" and j.reason.startswith("only the canary ran at capacity")


def test_a_real_gain_at_capacity_is_promoted_and_a_loss_rolled_back_whatever_the_load() -> None:
    """Both at capacity: tokens/s is each config's throughput, comparable across a lone
    replica's two windows even though they served different request counts."""
    faster = canary(requests=300, prompt_tokens_per_s=130.0, generation_tokens_per_s=65.0, **BUSY)
    j = judge(faster, before(requests=250, **BUSY), TARGET, SPEC, elapsed_s=400)
    assert j.verdict == "promote" and j.reason == "both at capacity: 195 vs 150 tokens/s per pod"
    slower = canary(requests=160, prompt_tokens_per_s=80.0, generation_tokens_per_s=40.0, **BUSY)
    j = judge(slower, others(**BUSY), TARGET, SPEC, elapsed_s=300)
    assert j.verdict == "rollback" and j.reason == "both at capacity: 120 vs 150 tokens/s per pod: lower by more than 5%"


def served(pod: str, requests: int, prompt: int, generated: int, *, target: bool = False,
           **fields: Any) -> WindowSummary:
    """A 300 s window of `requests` requests of `prompt` prompt and `generated` generated tokens
    each, on the target's config or the one before it."""
    return summary(pod, duration_s=300.0, block_size=8 if target else 16, mode="swap" if target else "recompute",
                   requests=requests, prompt_tokens_per_s=requests * prompt / 300,
                   generation_tokens_per_s=requests * generated / 300, **fields)


def test_a_change_of_request_mix_at_capacity_alone_promotes_nothing() -> None:
    """A lone replica saturated by chat before the change and by long documents after it, on a
    config no better: the long prompts' prefill doubles its tokens/s (what the capacity rule
    alone promoted on), and the mix shows that the traffic, not the config, changed."""
    chat = [served("canary", 600, prompt=150, generated=150, **BUSY)]
    documents = served("canary", 150, prompt=2000, generated=100, target=True, **BUSY)
    j = judge(documents, chat, TARGET, SPEC, elapsed_s=400)
    assert j.verdict == "wait"
    assert j.reason == ("the request mix differs by more than 20% (2000 vs 150 prompt, 100 vs 150 generated tokens "
                        "a request): the traffic changed, nothing compares")
    assert j.canary is not None and j.baseline is not None and j.canary.tokens_per_s > 1.5 * j.baseline.tokens_per_s
    assert judge(documents, chat, TARGET, SPEC, elapsed_s=900).verdict == "rollback"
    # nor does the way back, documents giving way to chat, blame the config
    j = judge(served("canary", 600, prompt=150, generated=150, target=True, **BUSY),
              [served("canary", 150, prompt=2000, generated=100, **BUSY)], TARGET, SPEC, elapsed_s=400)
    assert j.verdict == "wait" and j.reason.startswith("the request mix differs")


def test_the_mix_is_read_from_finished_requests_not_from_token_counters() -> None:
    """A short canary window at capacity: the token counters also hold the tokens of requests still
    running (here twice the finished ones' share of generated tokens), the requests that finished
    are the same chat as before: the mix compares, and the gain shows."""
    same = histogram([150.0] * 300, LENGTH_BUCKETS)
    faster = served("canary", 300, prompt=150, generated=300, target=True, generation_lengths=same, **BUSY)
    j = judge(faster, [served("canary", 240, prompt=150, generated=150, **BUSY)], TARGET, SPEC, elapsed_s=400)
    assert j.canary is not None and j.canary.generation_tokens_per_request == 150.0
    assert j.verdict == "promote" and j.reason == "both at capacity: 450 vs 240 tokens/s per pod"


def test_longer_answers_alone_promote_nothing() -> None:
    """Same prompts, answers four times as long: the generated share moves, the prompt length not."""
    j = judge(served("canary", 200, prompt=500, generated=400, target=True, **BUSY),
              [served("canary", 300, prompt=500, generated=100, **BUSY)], TARGET, SPEC, elapsed_s=400)
    assert j.verdict == "wait" and "400 vs 100 generated" in j.reason


def test_a_real_gain_at_capacity_under_the_same_mix_is_promoted() -> None:
    """Long documents before and after the change, a quarter more of them served."""
    j = judge(served("canary", 300, prompt=1000, generated=100, target=True, **BUSY),
              [served("canary", 240, prompt=1000, generated=100, **BUSY)], TARGET, SPEC, elapsed_s=400)
    assert j.verdict == "promote" and j.reason == "both at capacity: 1100 vs 880 tokens/s per pod"


def test_concurrent_pods_under_the_same_mix_judge_a_gain_while_the_phase_changes() -> None:
    """Every pod moved from chat to documents together: over the same span they share the mix,
    so the canary's extra capacity shows."""
    pods = [served(f"pod-{i}", 240, prompt=1000, generated=100, **BUSY) for i in range(2)]
    j = judge(served("canary", 300, prompt=1000, generated=100, target=True, **BUSY), pods, TARGET, SPEC,
              elapsed_s=300)
    assert j.verdict == "promote" and j.baseline is not None and j.baseline.num_pods == 2


def test_a_change_of_request_mix_below_capacity_promotes_nothing() -> None:
    """At the same request rate, documents then chat: the chat's TTFT is lower whatever the config."""
    j = judge(served("canary", 200, prompt=150, generated=150, target=True, ttft=0.05),
              [served("canary", 200, prompt=3000, generated=150, ttft=0.5)], TARGET, SPEC, elapsed_s=400)
    assert j.verdict == "wait" and j.reason.startswith("the request mix differs")


def test_a_real_latency_gain_at_a_comparable_load_is_promoted() -> None:
    j = judge(canary(requests=210, ttft=0.05), before(requests=200, ttft=0.5), TARGET, SPEC, elapsed_s=400)
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
    assert j.verdict == "wait"
    assert j.reason == "the canary pod reports block_size 16 (not 8), preemption_mode recompute (not swap): not the target"
    assert judge(stale, others(), TARGET, SPEC, elapsed_s=900).verdict == "rollback"


def test_a_canary_without_a_window_waits() -> None:
    assert judge(None, others(), TARGET, SPEC, elapsed_s=300).reason == "no window yet for the canary pod"
    assert judge(canary(), [], TARGET, SPEC, elapsed_s=300).reason == "no window yet for the baseline"
