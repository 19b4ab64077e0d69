"""One scrape of a serving pod's `/metrics`, parsed: a `Sample`.

Counters and histograms are kept per series (label set, `model_name` included) with the time the
series was created (`*_created`), so that a window can tell a reset (the pod restarted, or a new
series appeared) from an increase, series by series, as Prometheus's `rate()` does.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import reduce

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.runtime.tunables import TUNABLES, LiveConfig

from .tuning_spec import Knobs

# The runtime's metric names (ARCHITECTURE.md, "Metrics"), by the name the window uses.
GAUGES = {
    "kv_cache_usage": "kvpilot_kv_cache_usage_ratio",
    "num_waiting_seqs": "kvpilot_num_waiting_seqs",
    "num_running_seqs": "kvpilot_num_running_seqs",
    "num_swapped_seqs": "kvpilot_num_swapped_seqs",
    # requests, not sequences (a request with n > 1 holds several): the queue the autoscaler
    # reads, the series the HPA and KEDA read too, and with the running ones what a pod holds
    "num_requests_waiting": "vllm:num_requests_waiting",
    "num_requests_running": "vllm:num_requests_running",
}
COUNTERS = {
    "preemptions": "vllm:num_preemptions",
    "swap_bytes": "kvpilot_swap_bytes",  # both directions: what crossed the host link
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
}
HISTOGRAMS = {
    "iteration_time": "kvpilot_iteration_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    # token counts of each finished request: the request mix (signals.py)
    "prompt_lengths": "vllm:request_prompt_tokens",
    "generation_lengths": "vllm:request_generation_tokens",
}
CACHE_CONFIG_INFO = "vllm:cache_config_info"
LIVE_CONFIG_INFO = "kvpilot_live_config_info"  # a label per live tunable, by its name in the contract

Labels = tuple[tuple[str, str], ...]


class MetricsError(ValueError):
    """A `/metrics` page that is not Prometheus text, or lacks what the autotuner reads."""


@dataclass(frozen=True)
class EngineSettings:
    """What a pod reports in force: its live tunables (`kvpilot_live_config_info`) and its KV
    blocks (`vllm:cache_config_info`)."""

    config: LiveConfig
    num_gpu_blocks: int

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def preemption_mode(self) -> str:
        return self.config.preemption_mode

    @property
    def knobs(self) -> Knobs:
        return Knobs.of(self.config)


@dataclass(frozen=True)
class CounterPoint:
    value: float
    created: float | None  # the series' `_created`; a new value means the counter restarted

    def restarted_since(self, earlier: CounterPoint) -> bool:
        moved = self.created is not None and earlier.created is not None and self.created != earlier.created
        return moved or self.value < earlier.value

    def increase_since(self, earlier: CounterPoint | None) -> float:
        """The increase from `earlier`: all of the value for a new or restarted series."""
        if earlier is None or self.restarted_since(earlier):
            return self.value
        return self.value - earlier.value


@dataclass(frozen=True)
class Histogram:
    """Cumulative counts by upper bound (`bounds[-1]` is +Inf), as Prometheus exposes them. A
    window's increase is a Histogram too: the observations made within it."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float = 0.0
    created: float | None = None

    @property
    def count(self) -> float:
        return self.counts[-1]

    @property
    def mean(self) -> float | None:
        """The observations' mean; None without any."""
        return self.sum / self.count if self.count > 0 else None

    def restarted_since(self, earlier: Histogram) -> bool:
        moved = self.created is not None and earlier.created is not None and self.created != earlier.created
        return moved or self.bounds != earlier.bounds or self.count < earlier.count

    def increase_since(self, earlier: Histogram | None) -> Histogram:
        """What was observed since `earlier`: everything for a new or restarted series."""
        if earlier is None or self.restarted_since(earlier):
            return Histogram(self.bounds, self.counts, self.sum)
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts, strict=True)),
                         self.sum - earlier.sum)

    def __add__(self, other: Histogram) -> Histogram:
        """Both histograms' observations. Cumulative counts are exact at every bound, so differing
        bucket layouts (pods of two versions) merge exactly on the bounds they share."""
        if self.bounds == other.bounds:
            return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
                             self.sum + other.sum)
        mine, theirs = dict(zip(self.bounds, self.counts, strict=True)), dict(zip(other.bounds, other.counts, strict=True))
        shared = tuple(sorted(mine.keys() & theirs.keys()))
        return Histogram(shared, tuple(mine[b] + theirs[b] for b in shared), self.sum + other.sum)

    @staticmethod
    def merge(histograms: Iterable[Histogram]) -> Histogram:
        return reduce(Histogram.__add__, histograms)

    def quantile(self, q: float) -> float | None:
        """Prometheus's `histogram_quantile`: linear within the bucket that holds the rank; the
        highest finite bound when the rank falls in +Inf. None without observations."""
        if self.count <= 0:
            return None
        rank = q * self.count
        i = bisect.bisect_left(self.counts, rank)
        if i >= len(self.bounds) - 1:
            return self.bounds[-2] if len(self.bounds) > 1 else None
        lower = self.bounds[i - 1] if i > 0 else 0.0
        below = self.counts[i - 1] if i > 0 else 0.0
        in_bucket = self.counts[i] - below
        if in_bucket <= 0:
            return self.bounds[i]
        return lower + (self.bounds[i] - lower) * (rank - below) / in_bucket

    def count_at_most(self, value: float) -> float:
        """Observations <= value, interpolated linearly within its bucket; those past the highest
        finite bound are never counted, since nothing says how far past they lie."""
        finite = self.bounds[:-1]
        if not finite or value >= finite[-1]:
            return self.counts[-2] if finite else 0.0
        i = bisect.bisect_left(finite, value)
        lower = finite[i - 1] if i > 0 else 0.0
        below = self.counts[i - 1] if i > 0 else 0.0
        if value <= lower:
            return below
        return below + (self.counts[i] - below) * (value - lower) / (finite[i] - lower)


@dataclass(frozen=True)
class Sample:
    """One pod's metrics at `time` (seconds, the operator's wall clock when the page arrived)."""

    time: float
    settings: EngineSettings
    gauges: dict[str, float]  # GAUGES' keys; summed over series
    counters: dict[str, dict[Labels, CounterPoint]]  # COUNTERS' keys
    histograms: dict[str, dict[Labels, Histogram]]  # HISTOGRAMS' keys

    @property
    def tokens_in_kv_cache(self) -> float:
        """Token slots held by sequences (block-granular: each sequence's last block counts whole)."""
        s = self.settings
        return self.gauges["kv_cache_usage"] * s.num_gpu_blocks * s.block_size


@dataclass
class _Series:
    value: float = 0.0
    created: float | None = None
    buckets: dict[float, float] | None = None
    sum: float = 0.0


def parse_metrics(text: str, time: float) -> Sample:
    """A Sample from a `/metrics` page; MetricsError names what is wrong or missing."""
    values: dict[str, dict[Labels, _Series]] = defaultdict(lambda: defaultdict(_Series))
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                _take(values, s.name, s.labels, s.value)
    except MetricsError:
        raise
    except ValueError as e:
        raise MetricsError(f"not Prometheus text: {e}") from None

    def required(name: str) -> dict[Labels, _Series]:
        if not values.get(name):
            raise MetricsError(f"{name} is missing: not a kvpilot serving pod?")
        return values[name]

    gauges = {key: sum(s.value for s in required(name).values()) for key, name in GAUGES.items()}
    counters = {key: {labels: CounterPoint(s.value, s.created) for labels, s in required(name).items()}
                for key, name in COUNTERS.items()}
    histograms = {key: {labels: _histogram(name, s) for labels, s in required(name).items()}
                  for key, name in HISTOGRAMS.items()}
    settings = EngineSettings(_live_config(_info(required(LIVE_CONFIG_INFO), LIVE_CONFIG_INFO)),
                              _num_gpu_blocks(_info(required(CACHE_CONFIG_INFO), CACHE_CONFIG_INFO)))
    return Sample(time, settings, gauges, counters, histograms)


def _take(values: dict[str, dict[Labels, _Series]], name: str, labels: dict[str, str], value: float) -> None:
    """Files one exposed sample under its metric's base name and its series' labels."""
    le = labels.get("le")
    key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
    for suffix in ("_total", "_created", "_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            series = values[base][key]
            if suffix == "_created":
                series.created = value
            elif suffix == "_bucket":
                if le is None:
                    raise MetricsError(f"{name} has a bucket without an le label")
                series.buckets = series.buckets or {}
                series.buckets[float(le)] = value
            elif suffix == "_sum":
                series.sum = value
            elif suffix == "_total":
                series.value = value
            break
    else:
        values[name][key].value = value


def _histogram(name: str, series: _Series) -> Histogram:
    if not series.buckets or math.inf not in series.buckets:
        raise MetricsError(f"{name} has no +Inf bucket")
    bounds = tuple(sorted(series.buckets))
    return Histogram(bounds, tuple(series.buckets[b] for b in bounds), series.sum, series.created)


def _info(series: dict[Labels, _Series], name: str) -> dict[str, str]:
    """The labels of an info metric's one series at 1."""
    in_force = [dict(labels) for labels, s in series.items() if s.value == 1]
    if len(in_force) != 1:
        raise MetricsError(f"{name} should have one series at 1, not {len(in_force)}")
    return in_force[0]


def _live_config(labels: dict[str, str]) -> LiveConfig:
    try:
        return LiveConfig(**{t.name: t.kind(labels[t.name]) for t in TUNABLES})
    except (KeyError, ValueError) as e:
        raise MetricsError(f"{LIVE_CONFIG_INFO} needs a valid label for each of {', '.join(t.name for t in TUNABLES)}, "
                           f"not {labels}: {e}") from None


def _num_gpu_blocks(labels: dict[str, str]) -> int:
    try:
        return int(labels["num_gpu_blocks"])
    except (KeyError, ValueError):
        raise MetricsError(f"{CACHE_CONFIG_INFO} needs an integer num_gpu_blocks label, not {labels}") from None
