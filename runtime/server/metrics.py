"""Prometheus metrics of `kvpilot serve`: vLLM's `vllm:*` names (so vLLM dashboards, KEDA/HPA
adapters and scrapers work unchanged) and kvpilot's own `kvpilot_*` names, all with the
`model_name` label. Updated on the API process's event loop from every message of the engine
core (its snapshot and step stats, and the outputs they carry); each server owns its registry so
several can live in one process (tests).

Per-tenant series (`kvpilot_tenant_*`, label `tenant`) keep their label set bounded: the first
`MAX_TENANT_LABELS` tenants (the `--api-key-file` tenants first, registered at start) have their
own label for the server's life and every later tenant adds up under `tenant="other"`. A label
is never reassigned, so every counter stays monotonic and `sum by (tenant)` always adds up to
the whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from kvpilot.runtime.engine.messages import EngineSnapshot, StepStatsMsg
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.tunables import PREEMPTION_MODES, TUNABLES

logger = logging.getLogger(__name__)

# As vLLM does: a `*_created` series per counter and histogram doubles the page for no signal, and
# dashboards read `vllm:num_preemptions_created` (a timestamp) as a count.
disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)
_ITERATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's 1-2-5 series for a request's token counts (it stops at max_model_len; one series for any)
_LENGTH_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
MAX_TENANT_LABELS = 16
OTHER_TENANTS = "other"
TOKEN_KINDS = ("prompt", "generation")


class TenantLabels:
    """tenant -> label value, with at most `limit` named tenants plus "other" (module docstring)."""

    def __init__(self, limit: int, known: list[str]) -> None:
        self.limit = limit
        self.named: set[str] = set()
        for tenant in known:
            self.label(tenant)

    def label(self, tenant: str) -> str:
        if tenant in self.named:
            return tenant
        if len(self.named) < self.limit and tenant != OTHER_TENANTS:
            self.named.add(tenant)
            return tenant
        return OTHER_TENANTS

    @property
    def labels(self) -> list[str]:
        return [*sorted(self.named), OTHER_TENANTS]


class ServerMetrics:
    def __init__(self, model_name: str, tenants: list[str] | None = None,
                 max_tenant_labels: int = MAX_TENANT_LABELS, cache_dtype: str = "auto") -> None:
        self.model_name = model_name
        self.cache_dtype = cache_dtype  # --kv-cache-dtype, as vLLM's cache_config_info labels it
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests running on the engine.", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", m, registry=r)
        self.kv_usage_perc = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", m, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative preemptions.", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between generated tokens.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", m,
                             buckets=_REQUEST_BUCKETS, registry=r)
        # per finished request: its sums over counts are the mean request's shape over any span,
        # which the operator compares before judging one config's throughput against another's
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens of a finished request.",
                                               m, buckets=_LENGTH_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens of a finished request.", m,
                                                   buckets=_LENGTH_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time spent waiting before first scheduled.",
                                    m, buckets=_REQUEST_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               m + ["finished_reason"], registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", m, registry=r)
        self.cache_info = Gauge("vllm:cache_config_info", "The KV-cache configuration (value 1).",
                                m + ["block_size", "num_gpu_blocks", "preemption_mode", "enable_prefix_caching",
                                     "cache_dtype"], registry=r)
        # every live tunable, labelled by its name in the contract: what the operator checks each
        # pod runs (vLLM's cache_config_info carries only the cache's part)
        self.live_config_info = Gauge("kvpilot_live_config_info", "The live tunables in force (value 1).",
                                      m + [t.name for t in TUNABLES], registry=r)
        self.iteration_time = Histogram("kvpilot_iteration_time_seconds", "Duration of one engine step.", m,
                                        buckets=_ITERATION_BUCKETS, registry=r)
        self.num_running_seqs = Gauge("kvpilot_num_running_seqs", "Sequences running.", m, registry=r)
        self.num_waiting_seqs = Gauge("kvpilot_num_waiting_seqs", "Sequences waiting.", m, registry=r)
        self.num_swapped_seqs = Gauge("kvpilot_num_swapped_seqs", "Sequences swapped out to host memory.", m, registry=r)
        self.kv_usage_ratio = Gauge("kvpilot_kv_cache_usage_ratio", "Fraction of KV blocks in use.", m, registry=r)
        self.block_size = Gauge("kvpilot_block_size", "Tokens per KV block.", m, registry=r)
        self.preemption_mode = Gauge("kvpilot_preemption_mode", "1 for the preemption mode in force.", m + ["mode"], registry=r)
        self.preemptions_by_mode = Counter("kvpilot_preemptions", "Preemptions by mode.", m + ["mode"], registry=r)
        self.swap_bytes = Counter("kvpilot_swap_bytes", "Bytes of KV cache swapped, by direction.", m + ["direction"], registry=r)
        self.swap_seconds = Counter("kvpilot_swap_seconds", "Device time the swap copies took, by direction "
                                    "(they overlap the steps; counted when they complete).", m + ["direction"], registry=r)
        self.config_changes = Counter("kvpilot_config_changes", "Live configuration changes applied.", m, registry=r)
        self.tenant_served_tokens = Counter(
            "kvpilot_tenant_served_tokens", "Tokens served per tenant: prompt tokens computed (prefix-cache hits "
            "and recomputation excluded) and generated tokens.", m + ["tenant", "kind"], registry=r)
        self.tenant_waiting = Gauge("kvpilot_tenant_waiting_requests", "Requests waiting (or swapped out) per tenant.",
                                    m + ["tenant"], registry=r)
        self.tenants = TenantLabels(max_tenant_labels, tenants or [])
        # every series exists from the start, so scrapers and rate() see zeros, not gaps
        for metric in (self.running, self.waiting, self.kv_usage_perc, self.preemptions, self.prompt_tokens,
                       self.generation_tokens, self.ttft, self.itl, self.e2e, self.request_prompt_tokens,
                       self.request_generation_tokens, self.queue_time,
                       self.prefix_queries, self.prefix_hits, self.iteration_time, self.num_running_seqs,
                       self.num_waiting_seqs, self.num_swapped_seqs, self.kv_usage_ratio, self.block_size,
                       self.config_changes):
            metric.labels(model_name)
        for direction in ("in", "out"):
            self.swap_bytes.labels(model_name, direction)
            self.swap_seconds.labels(model_name, direction)
        for mode in PREEMPTION_MODES:
            self.preemptions_by_mode.labels(model_name, mode)
        for label in self.tenants.labels:
            self._add_tenant_series(label)
        self._cache_info_labels: tuple[str, ...] | None = None
        self._live_config_labels: tuple[str, ...] | None = None
        self._last_token_time: dict[str, float] = {}
        # for the periodic log line; reset by `take_interval`
        self._interval_steps = 0
        self._interval_time = 0.0

    def expose(self) -> bytes:
        return generate_latest(self.registry)

    def _add_tenant_series(self, label: str) -> None:
        for kind in TOKEN_KINDS:
            self.tenant_served_tokens.labels(self.model_name, label, kind)
        self.tenant_waiting.labels(self.model_name, label)

    def _record_tenants(self, snapshot: EngineSnapshot, stats: StepStatsMsg | None) -> None:
        name = self.model_name
        known = set(self.tenants.named)
        for tenant, (num_prompt, num_generated) in (stats.served_tokens if stats is not None else {}).items():
            label = self.tenants.label(tenant)
            self.tenant_served_tokens.labels(name, label, "prompt").inc(num_prompt)
            self.tenant_served_tokens.labels(name, label, "generation").inc(num_generated)
        waiting = dict.fromkeys(self.tenants.labels, 0)
        for tenant, count in snapshot.waiting_requests_by_tenant.items():
            label = self.tenants.label(tenant)
            waiting[label] = waiting.get(label, 0) + count
        for label in self.tenants.named - known:
            self._add_tenant_series(label)
        for label, count in waiting.items():
            self.tenant_waiting.labels(name, label).set(count)

    def record_config_change(self) -> None:
        self.config_changes.labels(self.model_name).inc()

    def record(self, outputs: list[RequestOutput], snapshot: EngineSnapshot, stats: StepStatsMsg | None,
               pending: Collection[str] = ()) -> None:
        """The engine's hook (`StepHook`): gauges from the core's snapshot, counters from the step's
        stats, latencies from the outputs; `pending` are the requests still open."""
        name = self.model_name
        self._record_config(snapshot)
        waiting_requests = snapshot.num_waiting_requests
        self.running.labels(name).set(snapshot.num_requests - waiting_requests)
        self.waiting.labels(name).set(waiting_requests)
        self.kv_usage_perc.labels(name).set(snapshot.kv_cache_usage)
        self.kv_usage_ratio.labels(name).set(snapshot.kv_cache_usage)
        self.num_running_seqs.labels(name).set(snapshot.num_running_seqs)
        self.num_waiting_seqs.labels(name).set(snapshot.num_waiting_seqs)
        self.num_swapped_seqs.labels(name).set(snapshot.num_swapped_seqs)
        self._record_tenants(snapshot, stats)
        if stats is not None:
            self._interval_steps += 1
            self._interval_time += stats.duration_s
            self.iteration_time.labels(name).observe(stats.duration_s)
            self.generation_tokens.labels(name).inc(stats.num_generation_tokens)
            if stats.num_preemptions:
                self.preemptions.labels(name).inc(stats.num_preemptions)
                # every preemption that did not swap out recomputes
                by_mode = {"swap": stats.num_swapped_out, "recompute": stats.num_preemptions - stats.num_swapped_out}
                for mode in PREEMPTION_MODES:  # a mode the contract adds fails here until it is counted
                    self.preemptions_by_mode.labels(name, mode).inc(by_mode[mode])
            self.swap_bytes.labels(name, "out").inc(stats.swap_out_bytes)
            self.swap_bytes.labels(name, "in").inc(stats.swap_in_bytes)
            self.swap_seconds.labels(name, "out").inc(stats.swap_out_seconds)
            self.swap_seconds.labels(name, "in").inc(stats.swap_in_seconds)
        for out in outputs:
            self._record_output(out)
        if len(self._last_token_time) > len(pending):  # aborted requests
            for request_id in [r for r in self._last_token_time if r not in pending]:
                del self._last_token_time[request_id]

    def _record_config(self, snapshot: EngineSnapshot) -> None:
        name = self.model_name
        live = snapshot.live
        if live is None or not snapshot.num_blocks:  # the core has not reported yet
            return
        self.block_size.labels(name).set(live.block_size)
        for mode in PREEMPTION_MODES:
            self.preemption_mode.labels(name, mode).set(1.0 if mode == live.preemption_mode else 0.0)
        labels = (name, str(live.block_size), str(snapshot.num_blocks), live.preemption_mode,
                  str(snapshot.enable_prefix_caching).lower(), self.cache_dtype)
        self._cache_info_labels = _info(self.cache_info, self._cache_info_labels, labels)
        tunables = (name, *(str(getattr(live, t.name)) for t in TUNABLES))
        self._live_config_labels = _info(self.live_config_info, self._live_config_labels, tunables)

    def _record_output(self, out: RequestOutput) -> None:
        name, m = self.model_name, out.metrics
        if m is None:
            return
        if m.last_token_time is not None:
            previous = self._last_token_time.get(out.request_id)
            if previous is None and m.first_token_time is not None:
                self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
                self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
            elif previous is not None and m.last_token_time > previous:
                self.itl.labels(name).observe(m.last_token_time - previous)
            self._last_token_time[out.request_id] = m.last_token_time
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            finished = m.finished_time or time.time()
            self.e2e.labels(name).observe(finished - m.arrival_time)
            self.request_prompt_tokens.labels(name).observe(len(out.prompt_token_ids))
            self.request_generation_tokens.labels(name).observe(sum(len(c.token_ids) for c in out.outputs))
            if m.first_scheduled_time is not None:
                self.queue_time.labels(name).observe(m.first_scheduled_time - m.arrival_time)
            reason = out.outputs[0].finish_reason or "abort"
            self.success.labels(name, reason).inc()
            self.prefix_queries.labels(name).inc(len(out.prompt_token_ids))
            self.prefix_hits.labels(name).inc(out.num_cached_tokens)

    def take_interval(self) -> tuple[int, float]:
        """(steps, seconds stepping) since the last call."""
        steps, seconds = self._interval_steps, self._interval_time
        self._interval_steps, self._interval_time = 0, 0.0
        return steps, seconds


def _info(gauge: Gauge, shown: tuple[str, ...] | None, labels: tuple[str, ...]) -> tuple[str, ...]:
    """An info metric's one series at 1: `labels` replace the `shown` ones; returns what it shows."""
    if labels != shown:
        if shown is not None:
            gauge.remove(*shown)
        gauge.labels(*labels).set(1)
    return labels
