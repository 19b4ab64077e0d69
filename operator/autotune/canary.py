"""The canary judgement: a pure function that decides whether a change tried on one pod goes to
all of them (promote), is undone (rollback), or needs more data (wait).

The canary pod's window since the change is compared with a *baseline*: the other pods over the
same span (concurrent, so they met the same traffic over time), or, with one replica, the canary's
own window of the same length before the change. Raw goodput is never compared: it follows the
offered load, which differs between two windows of one pod and between pods that a Service
happens to send different shares of its requests. Instead, on load-normalised figures:

* both sides *saturated* (requests queued, or sequences preempted fast: `outcomes.saturated`):
  each ran flat out, so its tokens per second (prompt plus generated, per pod) is its config's
  capacity, whatever the load was. The canary rolls back when its capacity is lower by more than
  `canary.tolerance`, and is promoted otherwise.
* neither saturated, at a *comparable offered load* (finished requests per second per pod within
  the comparable tolerance, the larger of twice `canary.tolerance` and 20%): the share of
  requests that met the SLO's TTFT and the P99 TTFT and ITL are compared. The canary rolls back
  when its share is lower by more than `tolerance` (absolute), or a P99 is higher by more than
  `tolerance` (relative) with no gain in the share; it is promoted otherwise.
* either way, only at a *comparable request mix* (prompt and generated tokens per request,
  `signals`, each within the comparable tolerance): capacity in tokens/s and latency both follow
  the mix (a long prompt's prefill runs many more tokens a second than decoding, and starts
  later), so a lone replica's two windows across a change of traffic — chat giving way to long
  documents — compare the traffic, not the configs. Concurrent pods meet the same mix, unless a
  few long requests fell unevenly: that waits too.
* anything else — one side saturated and not the other, loads or mixes too far apart — shows
  the traffic, not the config: the canary waits for windows that compare, and rolls back at the
  timeout.
A side with fewer than `min_requests` finished requests decides nothing either: the canary
waits, and rolls back once `timeout_s` has passed, since a change that cannot be shown to help
is not worth keeping.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvpilot.runtime.tunables import LiveConfig

from .outcomes import saturated
from .signals import Signals, aggregate, comparable_tolerance, differ
from .tuning_spec import Knobs, TuningSpec
from .window import WindowSummary

Verdict = Literal["promote", "rollback", "wait"]


@dataclass(frozen=True)
class CanaryJudgement:
    verdict: Verdict
    reason: str
    canary: Signals | None
    baseline: Signals | None


def judge(canary: WindowSummary | None, baseline: Sequence[WindowSummary], target: LiveConfig,
          spec: TuningSpec, *, elapsed_s: float) -> CanaryJudgement:
    """`canary`: the canary pod's window since the change (None if it could not be scraped);
    `baseline`: the windows it is compared with; `elapsed_s`: time since the change."""
    c = spec.canary
    timed_out = elapsed_s >= c.timeout_s
    if canary is None or not baseline:
        missing = "the canary pod" if canary is None else "the baseline"
        return _wait_or_give_up(f"no window yet for {missing}", timed_out, None, None)
    if differences := canary.settings.knobs.differences(Knobs.of(target)):
        return _wait_or_give_up(f"the canary pod reports {differences}: not the target", timed_out, None, None)
    mine, theirs = aggregate([canary], spec.slo), aggregate(baseline, spec.slo)
    if elapsed_s < c.window_s:
        return CanaryJudgement("wait", f"canary window: {elapsed_s:.0f} of {c.window_s:g} s", mine, theirs)
    if min(mine.num_requests, theirs.num_requests) < c.min_requests:
        return _wait_or_give_up(f"not enough requests: canary {mine.num_requests}, baseline "
                                f"{theirs.num_requests}, {c.min_requests} needed on each side", timed_out, mine, theirs)
    full = (saturated([canary], spec.thresholds), saturated(list(baseline), spec.thresholds))
    comparable = comparable_tolerance(c.tolerance)
    offered = f"{mine.requests_per_s:.3f} vs {theirs.requests_per_s:.3f} requests/s per pod"
    if full in ((True, False), (False, True)):
        side = "the canary" if full[0] else "the baseline"
        return _wait_or_give_up(f"only {side} ran at capacity ({offered}): the load differs, nothing compares",
                                timed_out, mine, theirs)
    if full == (False, False) and differ(mine.requests_per_s, theirs.requests_per_s, comparable):
        return _wait_or_give_up(f"offered loads differ by more than {comparable:.0%} ({offered}): nothing compares",
                                timed_out, mine, theirs)
    if mix := _mix_differs(mine, theirs, comparable):
        return _wait_or_give_up(mix, timed_out, mine, theirs)
    if full == (True, True):
        return _compare_capacity(mine, theirs, c.tolerance)
    return _compare_latency(mine, theirs, c.tolerance, offered)


def _mix_differs(mine: Signals, theirs: Signals, tolerance: float) -> str:
    """Why the two sides' request mixes do not compare; empty when they do."""
    prompt, generated = mine.prompt_tokens_per_request, mine.generation_tokens_per_request
    their_prompt, their_generated = theirs.prompt_tokens_per_request, theirs.generation_tokens_per_request
    if prompt is None or generated is None or their_prompt is None or their_generated is None:
        return "no request finished on one side: the request mix is unknown"
    if not (differ(prompt, their_prompt, tolerance) or differ(generated, their_generated, tolerance)):
        return ""
    return (f"the request mix differs by more than {tolerance:.0%} ({prompt:.0f} vs {their_prompt:.0f} prompt, "
            f"{generated:.0f} vs {their_generated:.0f} generated tokens a request): the traffic changed, "
            "nothing compares")


def _wait_or_give_up(why: str, timed_out: bool, mine: Signals | None, theirs: Signals | None) -> CanaryJudgement:
    if timed_out:
        return CanaryJudgement("rollback", f"inconclusive at the canary timeout: {why}", mine, theirs)
    return CanaryJudgement("wait", why, mine, theirs)


def _compare_capacity(mine: Signals, theirs: Signals, tolerance: float) -> CanaryJudgement:
    rates = (f"both at capacity: {mine.tokens_per_s:.0f} vs {theirs.tokens_per_s:.0f} tokens/s per pod")
    if mine.tokens_per_s < theirs.tokens_per_s * (1 - tolerance):
        return CanaryJudgement("rollback", f"{rates}: lower by more than {tolerance:.0%}", mine, theirs)
    return CanaryJudgement("promote", rates, mine, theirs)


def _compare_latency(mine: Signals, theirs: Signals, tolerance: float, offered: str) -> CanaryJudgement:
    share = f"SLO met by {mine.slo_share:.1%} vs {theirs.slo_share:.1%} of requests ({offered})"
    if mine.slo_share < theirs.slo_share - tolerance:
        return CanaryJudgement("rollback", f"{share}: lower by more than {tolerance:.0%}", mine, theirs)
    gained = mine.slo_share > theirs.slo_share + tolerance
    pairs = {"TTFT": (mine.ttft_p99_s, theirs.ttft_p99_s), "ITL": (mine.itl_p99_s, theirs.itl_p99_s)}
    latencies = {name: f"P99 {name} {_seconds(m)} vs {_seconds(t)}" for name, (m, t) in pairs.items()}
    worse = [latencies[name] for name, (m, t) in pairs.items()
             if m is not None and t is not None and m > t * (1 + tolerance)]
    if worse and not gained:
        return CanaryJudgement("rollback", f"{'; '.join(worse)}: higher by more than {tolerance:.0%} "
                                           f"with no gain in the SLO share ({share})", mine, theirs)
    return CanaryJudgement("promote", "; ".join([share, *latencies.values()]), mine, theirs)


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"
