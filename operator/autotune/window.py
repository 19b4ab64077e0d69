"""A pod's sliding window of samples, and its summary over a span of time.

A summary over (since, until] starts from a *baseline*: the newest sample at or before `since`
(the oldest one kept when there is none). Counters and histograms count what happened after the
baseline, step by step, so a restart between two samples loses nothing that was scraped and
counts nothing twice. Gauges and the settings in force are read from the samples after the
baseline only: each of those stands for the stretch of time that ends at it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import fmean

from .sample import HISTOGRAMS, EngineSettings, Histogram, Sample


@dataclass(frozen=True)
class WindowSummary:
    """What one pod did over (start, end]. Rates are per second; histograms hold the
    observations made within the span, so their quantiles are the span's own."""

    pod: str
    start: float
    end: float
    num_samples: int  # after the baseline
    settings: EngineSettings  # the latest
    settings_changed: bool  # the samples in the span do not all report the same settings
    num_restarts: int  # counter resets seen: the engine restarted
    kv_cache_usage: float  # means over the samples
    num_waiting_seqs: float
    num_running_seqs: float
    num_swapped_seqs: float
    num_requests_waiting: float  # requests (vllm:num_requests_waiting), where the above count sequences
    arrivals_per_s: float  # requests received: finished plus the change in those held
    mean_context_tokens: float | None  # KV tokens per running sequence; None if none ran
    preemptions_per_s: float
    swap_bytes_per_s: float
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    iteration_time: Histogram
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    prompt_lengths: Histogram  # prompt tokens of the requests finished within the span
    generation_lengths: Histogram  # their generated tokens

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    @property
    def num_requests(self) -> int:
        """Requests finished within the span."""
        return round(self.e2e.count)


class MetricWindow:
    """One pod's samples from the last `span_s` seconds, plus the newest older one as the
    baseline of a summary over the whole span."""

    def __init__(self, pod: str, span_s: float) -> None:
        if span_s <= 0:
            raise ValueError(f"span_s: must be positive, not {span_s}")
        self.pod = pod
        self.span_s = span_s
        self._samples: deque[Sample] = deque()

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def latest(self) -> Sample | None:
        return self._samples[-1] if self._samples else None

    def add(self, sample: Sample) -> bool:
        """Keeps the sample unless it is not newer than the latest (a wall clock stepped back)."""
        if self._samples and sample.time <= self._samples[-1].time:
            return False
        self._samples.append(sample)
        cutoff = sample.time - self.span_s
        while len(self._samples) > 1 and self._samples[1].time <= cutoff:
            self._samples.popleft()
        return True

    def summarize(self, since: float | None = None, until: float | None = None) -> WindowSummary | None:
        """The summary over (since, until]; None with fewer than two samples to span it."""
        samples = [s for s in self._samples if until is None or s.time <= until]
        if since is not None:
            older = [i for i, s in enumerate(samples) if s.time <= since]
            samples = samples[older[-1]:] if older else samples
        if len(samples) < 2:
            return None
        return _summarize(self.pod, samples)


def _summarize(pod: str, samples: list[Sample]) -> WindowSummary:
    """`samples[0]` is the baseline; see the module docstring."""
    base, span = samples[0], samples[1:]
    duration = span[-1].time - base.time
    steps = list(zip(samples, span, strict=False))
    counters = {key: _counter_increase(key, steps) for key in base.counters}
    histograms = {key: _histogram_increase(key, steps) for key in HISTOGRAMS}
    running = [(s.tokens_in_kv_cache, s.gauges["num_running_seqs"]) for s in span if s.gauges["num_running_seqs"] > 0]
    return WindowSummary(
        pod=pod, start=base.time, end=span[-1].time, num_samples=len(span),
        settings=span[-1].settings,
        settings_changed=any(s.settings != span[-1].settings for s in span),
        num_restarts=sum(1 for earlier, later in steps if _restarted(earlier, later)),
        kv_cache_usage=fmean(s.gauges["kv_cache_usage"] for s in span),
        num_waiting_seqs=fmean(s.gauges["num_waiting_seqs"] for s in span),
        num_running_seqs=fmean(s.gauges["num_running_seqs"] for s in span),
        num_swapped_seqs=fmean(s.gauges["num_swapped_seqs"] for s in span),
        num_requests_waiting=fmean(s.gauges["num_requests_waiting"] for s in span),
        arrivals_per_s=_arrivals(base, span[-1], histograms["e2e"].count) / duration,
        mean_context_tokens=fmean(tokens / seqs for tokens, seqs in running) if running else None,
        preemptions_per_s=counters["preemptions"] / duration,
        swap_bytes_per_s=counters["swap_bytes"] / duration,
        prompt_tokens_per_s=counters["prompt_tokens"] / duration,
        generation_tokens_per_s=counters["generation_tokens"] / duration,
        **histograms,
    )


def _arrivals(base: Sample, last: Sample, finished: float) -> float:
    """Requests received between the two samples: those finished plus the change in those held
    (an aborted request leaves uncounted); never below 0 (a restart's baseline held the old
    process's requests)."""
    def held(s: Sample) -> float:
        return s.gauges["num_requests_running"] + s.gauges["num_requests_waiting"]
    return max(0.0, finished + held(last) - held(base))


def _counter_increase(key: str, steps: list[tuple[Sample, Sample]]) -> float:
    """Summed over series and steps, each series reset-aware."""
    return sum(point.increase_since(earlier.counters[key].get(labels))
               for earlier, later in steps for labels, point in later.counters[key].items())


def _histogram_increase(key: str, steps: list[tuple[Sample, Sample]]) -> Histogram:
    increases = [hist.increase_since(earlier.histograms[key].get(labels))
                 for earlier, later in steps for labels, hist in later.histograms[key].items()]
    return Histogram.merge(increases)


def _restarted(earlier: Sample, later: Sample) -> bool:
    """A reset of a series both samples have (a series new in `later` is no restart)."""
    return any(point.restarted_since(earlier.counters[key][labels])
               for key, series in later.counters.items()
               for labels, point in series.items() if labels in earlier.counters[key])
