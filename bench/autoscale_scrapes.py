"""What the fleet simulator's scrapes see of a replica, and the windows a policy reads from them.

A scrape records a Ready replica's gauges as a scrape of its `/metrics` sees them: varying around
the capacity curve's means at its load (waiting a geometric count, as a queue's length is;
running a Poisson count; KV usage in proportion to running) plus its backlog, with its counters
(preemptions, requests received, TTFTs in the runtime's histogram buckets). `summarize` folds a
replica's scrapes into the `WindowSummary` the operator's scraper would hand a policy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvpilot.bench.capacity_curve import CapacityCurve
from kvpilot.operator.autotune import EngineSettings, Histogram, LiveConfig, WindowSummary

# The runtime's TTFT buckets (runtime/server/metrics.py), so a P99 read from the simulated histograms
# has the resolution it has in a cluster.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_EMPTY = Histogram((math.inf,), (0.0,))
_SETTINGS = EngineSettings(LiveConfig(16, "recompute", 256, 2048), 1)
_GAUGES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage")


@dataclass(frozen=True)
class Scrape:
    time: float
    waiting: float
    running: float
    kv: float
    preemptions: float  # counter
    arrivals: float  # counter: requests received
    ttft: np.ndarray  # counts per bucket (not cumulative), +Inf last; counter


def draw_gauges(curve: CapacityCurve, rng: np.random.Generator, rate: float,
                backlog: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(waiting, running, KV usage) of each Ready replica, offered `rate` among them, with
    `backlog` queued each (a replica with a backlog shows the curve at its capacity)."""
    cap = curve.capacity
    loads = np.array([min(rate / len(backlog), cap), cap])
    means = np.array([curve.gauge_at(g, loads) if g in curve.gauges else np.zeros(2) for g in _GAUGES])
    waiting_mean, running_mean, kv_mean = means[:, (backlog > 0).astype(np.int64)]  # each (replicas,)
    waiting = rng.geometric(1 / (1 + waiting_mean)) - 1 + backlog
    running = rng.poisson(running_mean).astype(np.float64)
    busy = running_mean > 0
    kv = np.where(busy, np.minimum(1.0, kv_mean * running / np.where(busy, running_mean, 1.0)), kv_mean)
    return waiting, running, kv


def summarize(pod: str, scrapes: Iterable[Scrape], now: float, window: float, *, in_range: bool = False,
              with_ttft: bool = False) -> WindowSummary | None:
    """The window the operator's scraper hands a policy: the scrapes in (now - window, now], after
    the newest one at or before its start (`MetricWindow.summarize`). `in_range`: as Prometheus's
    avg_over_time reads the gauges instead, every scrape within the range, one being enough.
    `with_ttft`: the TTFT histogram too (only a policy on ttftP99 reads it)."""
    older: list[Scrape] = []
    inside: list[Scrape] = []
    for s in scrapes:
        (inside if s.time > now - window else older).append(s)
    if in_range:
        base = inside[0] if inside else None
    else:
        base = older[-1] if older else (inside.pop(0) if inside else None)
    if base is None or not inside:
        return None
    last = inside[-1]
    dt = last.time - base.time
    waiting = sum(s.waiting for s in inside) / len(inside)
    return WindowSummary(
        pod=pod, start=base.time, end=last.time, num_samples=len(inside), settings=_SETTINGS,
        settings_changed=False, num_restarts=0,
        kv_cache_usage=sum(s.kv for s in inside) / len(inside),
        num_waiting_seqs=waiting, num_requests_waiting=waiting,  # one sequence a request
        num_running_seqs=sum(s.running for s in inside) / len(inside),
        num_swapped_seqs=0.0, mean_context_tokens=None,
        arrivals_per_s=(last.arrivals - base.arrivals) / dt if dt > 0 else 0.0,
        preemptions_per_s=(last.preemptions - base.preemptions) / dt if dt > 0 else 0.0,
        swap_bytes_per_s=0.0, prompt_tokens_per_s=0.0, generation_tokens_per_s=0.0,
        iteration_time=_EMPTY, itl=_EMPTY, e2e=_EMPTY, prompt_lengths=_EMPTY, generation_lengths=_EMPTY,
        ttft=Histogram((*TTFT_BUCKETS, math.inf), tuple(np.cumsum(last.ttft - base.ttft).tolist()))
        if with_ttft else _EMPTY)
