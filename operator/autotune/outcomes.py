"""The autotuner's memory: what each block size and preemption mode measured while the service
ran at its capacity, so that the policy can keep what paid on this hardware and leave what did not.

Terms. *Saturated*: a pod's window in which requests waited (mean queue depth at least one and at
least `queue_depth_low`) or sequences were preempted at `preemptions_per_s_high` or faster: the
engine ran flat out, so the tokens it got through per second are the configuration's capacity,
not the load's. *Throughput*: prompt plus generation tokens per second (a prompt counts once per
request, so the prefill a recompute preemption repeats is not counted as work). A configuration's
*estimate* is the duration-weighted mean throughput over every saturated window observed under it;
its standard error comes from the spread between windows, and two estimates differ only by more
than `canary.tolerance` and twice the noise of the difference. It is *measured* once its windows
add up to the canary's window (`canary.window_s`: the time
a change is given to show what it is worth). Goodput cannot be compared this way: it follows the
offered load, which is what changed when the policy switched.

Windows are fed once each (the caller passes the span since its previous call), so a long stretch
under one configuration is not counted twice. Estimates are per service and live as long as the
tuner that holds them; a change of hardware or model comes with a rollout, which starts afresh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import fmean

from .tuning_spec import EngineTarget, Thresholds
from .window import WindowSummary


@dataclass(frozen=True)
class Estimate:
    tokens_per_s: float  # per pod, mean over the saturated windows weighted by their length
    stderr: float  # of that mean, from the spread between windows; inf with one window
    seconds: float  # saturated time behind it (summed over windows, the shortest pod's span)
    num_windows: int

    def beats(self, other: Estimate, tolerance: float) -> bool:
        """Higher by more than `tolerance` (relative) and by more than twice the noise of the
        difference: a gap inside either counts as no difference."""
        noise = 2 * math.hypot(self.stderr, other.stderr)
        return self.tokens_per_s - other.tokens_per_s > max(tolerance * other.tokens_per_s, noise)


class Outcomes:
    def __init__(self) -> None:
        self._sums: dict[EngineTarget, tuple[float, float, float, int]] = {}  # seconds, sum w*x, sum w*x^2, windows

    def observe(self, summaries: Mapping[str, WindowSummary], thresholds: Thresholds, *,
                last_change: float | None = None) -> EngineTarget | None:
        """Adds the span the pods' `summaries` cover if they all ran one configuration throughout
        and were saturated; returns that configuration, or None when the span was not counted.
        A span that begins before `last_change` (the latest switch) holds work of two configurations
        and is not counted."""
        if not summaries or any(last_change is not None and s.start < last_change for s in summaries.values()):
            return None
        settings = {(s.settings.block_size, s.settings.preemption_mode) for s in summaries.values()}
        if len(settings) != 1 or any(s.settings_changed or s.num_restarts for s in summaries.values()):
            return None
        windows = list(summaries.values())
        if not saturated(windows, thresholds):
            return None
        key = EngineTarget(*settings.pop())
        seconds = min(s.duration_s for s in windows)
        if seconds <= 0:
            return None
        rate = fmean((s.prompt_tokens_per_s + s.generation_tokens_per_s) for s in windows)
        w, sx, sxx, n = self._sums.get(key, (0.0, 0.0, 0.0, 0))
        self._sums[key] = (w + seconds, sx + seconds * rate, sxx + seconds * rate * rate, n + 1)
        return key

    def estimate(self, config: EngineTarget) -> Estimate | None:
        """Whatever has been observed, measured or not."""
        if config not in self._sums:
            return None
        w, sx, sxx, n = self._sums[config]
        mean = sx / w
        variance = max(0.0, sxx / w - mean * mean)
        stderr = math.sqrt(variance / (n - 1)) if n > 1 else math.inf
        return Estimate(mean, stderr, w, n)

    def measured(self, min_seconds: float) -> dict[EngineTarget, Estimate]:
        """The estimates backed by at least `min_seconds` of saturated data: what the policy uses."""
        out = {}
        for config in self._sums:
            e = self.estimate(config)
            if e is not None and e.seconds >= min_seconds:
                out[config] = e
        return out


def saturated(windows: list[WindowSummary], t: Thresholds) -> bool:
    queue = fmean(s.num_waiting_seqs for s in windows)
    preemptions = fmean(s.preemptions_per_s for s in windows)
    return (queue >= max(1.0, t.queue_depth_low)) or preemptions >= t.preemptions_per_s_high
