"""One load run's figures: latency percentiles, throughput, errors and goodput.

The dict `summarize` returns is a run entry of `kvpilot bench serve --output` and a point of the
capacity curve the autoscaling simulator reads (bench/capacity_curve.py): `request_rate`,
`request_throughput`, and `ttft`/`itl`/`e2e` as `{"mean", "p50", "p90", "p99"}` in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .loadgen import RequestResult
from .percentile import percentile
from .slo import Slo

QUANTILES = {"p50": 50, "p90": 90, "p99": 99}


def latency_stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    array = np.asarray(values, dtype=np.float64)
    stats = {"mean": float(array.mean())}
    stats.update({name: percentile(array, q) for name, q in QUANTILES.items()})
    return stats


def summarize(results: Sequence[RequestResult], duration_s: float, request_rate: float,
              slo: Slo | None = None) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output_tokens = sum(r.output_len for r in done)
    input_tokens = sum(r.prompt_len or 0 for r in done)
    errors: dict[str, int] = {}
    for r in failed:
        errors[str(r.error)] = errors.get(str(r.error), 0) + 1
    summary: dict[str, Any] = {
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(failed),
        "errors": errors,
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s > 0 else 0.0,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "ttft": latency_stats([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl": latency_stats([gap for r in done for gap in r.itls_s]),
        "e2e": latency_stats([r.e2e_s for r in done if r.e2e_s is not None]),
    }
    if slo is not None:
        good = sum(1 for r in results if slo.met_by(r))
        summary["slo"] = slo.describe()
        summary["goodput"] = good / duration_s if duration_s > 0 else 0.0
        summary["slo_attainment"] = good / len(results) if results else 0.0
        summary["meets_slo"] = meets_slo(summary, slo)
    return summary


def meets_slo(summary: dict[str, Any], slo: Slo) -> bool:
    """Every request finished and the P99 of each latency the SLO names is within its limit."""
    if summary["failed"] or not summary["completed"]:
        return False
    for key, limit in slo.limits().items():
        stats = summary[key]
        if stats is not None and stats["p99"] > limit:
            return False
    return True


def format_summary(summary: dict[str, Any]) -> str:
    """The human table of one run, as vLLM's benchmark prints it."""
    rate = summary["request_rate"]
    lines = [f"{'=' * 18} request rate {rate if rate == 'inf' else f'{rate:g}'} req/s {'=' * 18}",
             f"{'Successful requests:':<40}{summary['completed']:>10}",
             f"{'Failed requests:':<40}{summary['failed']:>10}",
             f"{'Benchmark duration (s):':<40}{summary['duration_s']:>10.2f}",
             f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>10.2f}",
             f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>10.1f}",
             f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>10.1f}"]
    if "goodput" in summary:
        lines.append(f"{'Goodput (req/s, ' + summary['slo'] + '):':<40}{summary['goodput']:>10.2f}")
    for key, title in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E")):
        stats = summary[key]
        if stats is None:
            continue
        for name in ("mean", *QUANTILES):
            lines.append(f"{f'{title} {name} (ms):':<40}{1000 * stats[name]:>10.2f}")
    for key in ("kv_cache_usage", "num_requests_waiting", "num_requests_running", "preemptions_per_s"):
        if key in summary:
            lines.append(f"{f'server {key} (mean):':<40}{summary[key]:>10.3f}")
    for error, count in summary["errors"].items():
        lines.append(f"error x{count}: {error}")
    return "\n".join(lines)
