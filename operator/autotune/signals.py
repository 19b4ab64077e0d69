"""Pod window summaries folded into what the policy and the canary judge on.

Levels and rates are per pod (means over the pods), because a Service spreads requests evenly
and the thresholds are a single engine's; quantiles come from the pods' histograms merged, which
is exact, never from an average of per-pod quantiles.

The *request mix* is what an average request asks for: the mean prompt and generated tokens of
the requests finished in the span (`vllm:request_prompt_tokens`, `vllm:request_generation_tokens`:
exact per request, where token counters over a span shorter than a request's life mix in the
requests still running). A config does not change it; the traffic does, and with it the tokens/s
an engine gets through at capacity (a long prompt's prefill runs far more tokens per second than
decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean

from .sample import Histogram
from .tuning_spec import SloTargets
from .window import WindowSummary

MIN_COMPARABLE = 0.2  # offered loads and request mixes within this (relative) compare


def comparable_tolerance(tolerance: float) -> float:
    """How far apart (relative) two loads or mixes may lie and still compare: the larger of twice
    `canary.tolerance` and `MIN_COMPARABLE`."""
    return max(2 * tolerance, MIN_COMPARABLE)


def differ(mine: float, theirs: float, tolerance: float) -> bool:
    return abs(mine - theirs) > tolerance * max(theirs, 1e-9)


def request_mix(summaries: Sequence[WindowSummary]) -> tuple[float, float] | None:
    """The mean prompt and generated tokens of the requests the pods finished; None without any."""
    prompts = Histogram.merge(s.prompt_lengths for s in summaries)
    generated = Histogram.merge(s.generation_lengths for s in summaries)
    if prompts.mean is None or generated.mean is None:
        return None
    return prompts.mean, generated.mean


def mixes_differ(mine: tuple[float, float], theirs: tuple[float, float], tolerance: float) -> bool:
    return any(differ(m, t, tolerance) for m, t in zip(mine, theirs, strict=True))


@dataclass(frozen=True)
class Signals:
    """The metrics behind a decision; recorded with it."""

    num_pods: int
    duration_s: float  # the shortest pod span
    queue_depth: float  # waiting sequences
    kv_cache_usage: float
    num_running_seqs: float
    preemptions_per_s: float
    swap_bytes_per_s: float
    mean_context_tokens: float | None
    generation_tokens_per_s: float
    tokens_per_s: float  # prompt plus generated: at capacity, the config's throughput
    prompt_tokens_per_request: float | None  # the request mix (module docstring); None without a finished request
    generation_tokens_per_request: float | None
    requests_per_s: float  # finished
    goodput_per_s: float  # finished requests that met the TTFT target (all of them without one)
    slo_share: float  # of the requests with a first token, those within the TTFT target (1 without one)
    num_requests: int  # finished, all pods
    ttft_p99_s: float | None
    itl_p99_s: float | None
    e2e_p99_s: float | None


def aggregate(summaries: Sequence[WindowSummary], slo: SloTargets) -> Signals:
    if not summaries:
        raise ValueError("summaries: at least one pod's window is needed")
    ttft = Histogram.merge(s.ttft for s in summaries)
    contexts = [s.mean_context_tokens for s in summaries if s.mean_context_tokens is not None]
    mix = request_mix(summaries)
    return Signals(
        num_pods=len(summaries),
        duration_s=min(s.duration_s for s in summaries),
        queue_depth=fmean(s.num_waiting_seqs for s in summaries),
        kv_cache_usage=fmean(s.kv_cache_usage for s in summaries),
        num_running_seqs=fmean(s.num_running_seqs for s in summaries),
        preemptions_per_s=fmean(s.preemptions_per_s for s in summaries),
        swap_bytes_per_s=fmean(s.swap_bytes_per_s for s in summaries),
        mean_context_tokens=fmean(contexts) if contexts else None,
        generation_tokens_per_s=fmean(s.generation_tokens_per_s for s in summaries),
        tokens_per_s=fmean(s.prompt_tokens_per_s + s.generation_tokens_per_s for s in summaries),
        prompt_tokens_per_request=None if mix is None else mix[0],
        generation_tokens_per_request=None if mix is None else mix[1],
        requests_per_s=fmean(s.e2e.count / s.duration_s for s in summaries),
        goodput_per_s=fmean(_goodput(s, slo) for s in summaries),
        slo_share=1.0 if slo.ttft_p99_s is None or ttft.count == 0 else ttft.count_at_most(slo.ttft_p99_s) / ttft.count,
        num_requests=sum(s.num_requests for s in summaries),
        ttft_p99_s=ttft.quantile(0.99),
        itl_p99_s=Histogram.merge(s.itl for s in summaries).quantile(0.99),
        e2e_p99_s=Histogram.merge(s.e2e for s in summaries).quantile(0.99),
    )


def _goodput(s: WindowSummary, slo: SloTargets) -> float:
    """Finished requests per second times the share whose first token came within the target.
    TTFT is the one per-request SLO the metrics carry: ITL is exported per token, so it is
    judged by its P99 instead of being folded in here."""
    rate = s.e2e.count / s.duration_s
    if slo.ttft_p99_s is None or s.ttft.count == 0:
        return rate
    return rate * s.ttft.count_at_most(slo.ttft_p99_s) / s.ttft.count
