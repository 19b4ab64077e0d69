"""The canary judgement: a pure function that decides whether a change tried on one pod goes to
all of them (promote), is undone (rollback), or needs more data (wait).

The canary pod's window since the change is compared with a *baseline*: the other pods over the
same span, or, with one replica, the canary's own window of the same length before the change.
Both sides are judged per pod, on goodput (finished requests per second that met the TTFT
target) and on P99 TTFT and ITL. A side with fewer than `min_requests` finished requests decides
nothing: the canary waits, and rolls back once `timeout_s` has passed without enough traffic,
since a change that cannot be shown to help is not worth keeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .live_config import LiveConfig
from .signals import Signals, aggregate
from .tuning_spec import TuningSpec
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
    reported = (canary.settings.block_size, canary.settings.preemption_mode)
    if reported != (target.block_size, target.preemption_mode):
        return _wait_or_give_up(f"the canary pod reports block_size {reported[0]}, {reported[1]}, not the "
                                f"target's {target.block_size}, {target.preemption_mode}", timed_out, None, None)
    mine, theirs = aggregate([canary], spec.slo), aggregate(baseline, spec.slo)
    if elapsed_s < c.window_s:
        return CanaryJudgement("wait", f"canary window: {elapsed_s:.0f} of {c.window_s:g} s", mine, theirs)
    if min(mine.num_requests, theirs.num_requests) < c.min_requests:
        return _wait_or_give_up(f"not enough requests: canary {mine.num_requests}, baseline "
                                f"{theirs.num_requests}, {c.min_requests} needed on each side", timed_out, mine, theirs)
    return _compare(mine, theirs, c.tolerance)


def _wait_or_give_up(why: str, timed_out: bool, mine: Signals | None, theirs: Signals | None) -> CanaryJudgement:
    if timed_out:
        return CanaryJudgement("rollback", f"inconclusive at the canary timeout: {why}", mine, theirs)
    return CanaryJudgement("wait", why, mine, theirs)


def _compare(mine: Signals, theirs: Signals, tolerance: float) -> CanaryJudgement:
    goodput = f"goodput {mine.goodput_per_s:.3f}/s vs {theirs.goodput_per_s:.3f}/s"
    if mine.goodput_per_s < theirs.goodput_per_s * (1 - tolerance):
        return CanaryJudgement("rollback", f"{goodput}: lower by more than {tolerance:.0%}", mine, theirs)
    gained = mine.goodput_per_s > theirs.goodput_per_s * (1 + tolerance)
    pairs = {"TTFT": (mine.ttft_p99_s, theirs.ttft_p99_s), "ITL": (mine.itl_p99_s, theirs.itl_p99_s)}
    latencies = {name: f"P99 {name} {_seconds(m)} vs {_seconds(t)}" for name, (m, t) in pairs.items()}
    worse = [latencies[name] for name, (m, t) in pairs.items()
             if m is not None and t is not None and m > t * (1 + tolerance)]
    if worse and not gained:
        return CanaryJudgement("rollback", f"{'; '.join(worse)}: higher by more than {tolerance:.0%} "
                                           f"with no goodput gain ({goodput})", mine, theirs)
    return CanaryJudgement("promote", "; ".join([goodput, *latencies.values()]), mine, theirs)


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"
