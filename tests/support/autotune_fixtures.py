"""Inputs for the autotuner's tests: a serving pod's `/metrics` page as prometheus_client writes
it (the runtime's names and buckets), and window summaries built field by field."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    generate_latest,
)
from prometheus_client import metrics as prometheus_metrics

from kvpilot.operator.autotune import EngineSettings, LiveConfig, WindowSummary
from kvpilot.operator.autotune import Histogram as Hist
from kvpilot.runtime.tunables import TUNABLES

# runtime/server/metrics.py
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0)
ITERATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LENGTH_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))


class PodMetrics:
    """The series a kvpilot pod exports, in a registry of their own. A new instance is a
    restarted pod: counters from zero, new `_created` times."""

    def __init__(self, model: str = "m", block_size: int = 16, mode: str = "recompute",
                 num_gpu_blocks: int = 1000, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048) -> None:
        r, m = CollectorRegistry(), ["model_name"]
        self.registry, self.model = r, model
        self.gauges = {name: Gauge(name, name, m, registry=r).labels(model) for name in (
            "kvpilot_kv_cache_usage_ratio", "kvpilot_num_waiting_seqs", "kvpilot_num_running_seqs",
            "kvpilot_num_swapped_seqs", "vllm:num_requests_waiting", "vllm:num_requests_running")}
        self.preemptions = Counter("vllm:num_preemptions", "", m, registry=r).labels(model)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "", m, registry=r).labels(model)
        self.generation_tokens = Counter("vllm:generation_tokens", "", m, registry=r).labels(model)
        swap = Counter("kvpilot_swap_bytes", "", m + ["direction"], registry=r)
        self.swap_in, self.swap_out = swap.labels(model, "in"), swap.labels(model, "out")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "", m, buckets=LATENCY_BUCKETS, registry=r).labels(model)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "", m, buckets=LATENCY_BUCKETS, registry=r).labels(model)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "", m, buckets=REQUEST_BUCKETS, registry=r).labels(model)
        self.iteration = Histogram("kvpilot_iteration_time_seconds", "", m, buckets=ITERATION_BUCKETS,
                                   registry=r).labels(model)
        self.prompt_lengths = Histogram("vllm:request_prompt_tokens", "", m, buckets=LENGTH_BUCKETS,
                                        registry=r).labels(model)
        self.generation_lengths = Histogram("vllm:request_generation_tokens", "", m, buckets=LENGTH_BUCKETS,
                                            registry=r).labels(model)
        self._info = Gauge("vllm:cache_config_info", "", m + ["block_size", "num_gpu_blocks", "preemption_mode",
                                                              "enable_prefix_caching"], registry=r)
        self._live = Gauge("kvpilot_live_config_info", "", m + [t.name for t in TUNABLES], registry=r)
        self._info_labels: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self.configure(LiveConfig(block_size, mode, max_num_seqs, max_num_batched_tokens), num_gpu_blocks)

    def configure(self, config: LiveConfig, num_gpu_blocks: int) -> None:
        """The engine's config changed (a live change, or a re-cut of `num_gpu_blocks` blocks)."""
        if self._info_labels is not None:
            self._info.remove(*self._info_labels[0])
            self._live.remove(*self._info_labels[1])
        self._info_labels = ((self.model, str(config.block_size), str(num_gpu_blocks), config.preemption_mode, "false"),
                             (self.model, *(str(getattr(config, t.name)) for t in TUNABLES)))
        self._info.labels(*self._info_labels[0]).set(1)
        self._live.labels(*self._info_labels[1]).set(1)

    def set(self, waiting: float = 0, running: float = 0, swapped: float = 0, kv: float = 0.0) -> None:
        # one sequence a request: requests and sequences count alike
        for name, value in (("kvpilot_num_waiting_seqs", waiting), ("kvpilot_num_running_seqs", running),
                            ("kvpilot_num_swapped_seqs", swapped), ("kvpilot_kv_cache_usage_ratio", kv),
                            ("vllm:num_requests_waiting", waiting), ("vllm:num_requests_running", running)):
            self.gauges[name].set(value)

    def serve(self, requests: int, ttft: float = 0.05, itl: float = 0.02, e2e: float = 0.4,
              prompt_tokens: int = 100, output_tokens: int = 10) -> None:
        """`requests` requests finished, each with the same latencies."""
        for _ in range(requests):
            self.ttft.observe(ttft)
            self.e2e.observe(e2e)
            for _ in range(output_tokens - 1):
                self.itl.observe(itl)
            self.prompt_tokens.inc(prompt_tokens)
            self.generation_tokens.inc(output_tokens)
            self.prompt_lengths.observe(prompt_tokens)
            self.generation_lengths.observe(output_tokens)

    def text(self) -> str:
        """The page with `_created` series, as prometheus_client writes by default (tests that want
        a page without them strip them): kvpilot serve turns them off process-wide when its
        metrics module is imported, which the test process may have done."""
        was_on = getattr(prometheus_metrics, "_use_created", True)
        enable_created_metrics()
        try:
            return generate_latest(self.registry).decode()
        finally:
            if not was_on:
                disable_created_metrics()


def histogram(observations: Iterable[float], bounds: Iterable[float] = LATENCY_BUCKETS) -> Hist:
    """The cumulative histogram of `observations` in the runtime's buckets."""
    values, edges = list(observations), (*bounds, math.inf)
    return Hist(edges, tuple(float(sum(1 for v in values if v <= b)) for b in edges), float(sum(values)))


def summary(pod: str = "pod-0", duration_s: float = 60.0, block_size: int = 16, mode: str = "recompute",
            requests: int = 200, ttft: float = 0.05, itl: float = 0.02, max_num_seqs: int = 256,
            max_num_batched_tokens: int = 2048, **fields: Any) -> WindowSummary:
    """A pod's window over `duration_s` ending at t=1000 with `requests` finished requests of the
    given latencies, run on the given knobs; every other field from `fields` or a calm default.
    Each request's prompt and generated tokens are the token rates' share of it."""
    prompt_rate, generation_rate = fields.get("prompt_tokens_per_s", 100.0), fields.get("generation_tokens_per_s", 50.0)
    per_request = [duration_s * rate / requests if requests else 0.0 for rate in (prompt_rate, generation_rate)]
    base = WindowSummary(
        pod=pod, start=1000.0 - duration_s, end=1000.0, num_samples=int(duration_s // 10) or 1,
        settings=EngineSettings(LiveConfig(block_size, mode, max_num_seqs, max_num_batched_tokens), 1000),
        settings_changed=False, num_restarts=0,
        kv_cache_usage=0.2, num_waiting_seqs=0.0, num_running_seqs=4.0, num_swapped_seqs=0.0,
        num_requests_waiting=fields.get("num_waiting_seqs", 0.0), arrivals_per_s=requests / duration_s,
        mean_context_tokens=300.0, preemptions_per_s=0.0, swap_bytes_per_s=0.0,
        prompt_tokens_per_s=100.0, generation_tokens_per_s=50.0,
        iteration_time=histogram([0.02] * requests, ITERATION_BUCKETS),
        ttft=histogram([ttft] * requests), itl=histogram([itl] * requests * 9),
        e2e=histogram([0.4] * requests, REQUEST_BUCKETS),
        prompt_lengths=histogram([per_request[0]] * requests, LENGTH_BUCKETS),
        generation_lengths=histogram([per_request[1]] * requests, LENGTH_BUCKETS))
    return dataclasses.replace(base, **fields)
