"""The simulator's own check: one simulated replica, offered each rate of the capacity curve at
a steady Poisson rate, must give back the curve's P50/P90/P99 TTFT, ITL and E2E and its
throughput, each within `tolerance` (10%). It checks the parts between the curve and the
results (the interpolation, the latency draws, the arrivals, the queue), not the curve itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kvpilot.bench.arrival_trace import Trace
from kvpilot.bench.capacity_curve import LATENCIES, PERCENTILES, CapacityCurve
from kvpilot.bench.fleet import Pipeline, Policy, SimConfig, simulate

TOLERANCE = 0.10


@dataclass(frozen=True)
class CheckRow:
    request_rate: float
    measured: dict[str, float]  # ttft_p50 ... e2e_p99 (seconds), throughput (req/s)
    simulated: dict[str, float]

    @property
    def errors(self) -> dict[str, float]:
        return {k: abs(self.simulated[k] - m) / m if m > 0 else abs(self.simulated[k]) for k, m in self.measured.items()}

    @property
    def max_error(self) -> float:
        return max(self.errors.values())


@dataclass(frozen=True)
class SelfCheck:
    rows: tuple[CheckRow, ...]
    tolerance: float

    @property
    def max_error(self) -> float:
        return max(r.max_error for r in self.rows)

    @property
    def passed(self) -> bool:
        return self.max_error <= self.tolerance

    def describe(self) -> str:
        worst = max(self.rows, key=lambda r: r.max_error)
        key = max(worst.errors, key=worst.errors.__getitem__)
        verdict = "passed" if self.passed else "FAILED"
        return (f"self-check {verdict}: one simulated replica reproduces the curve's {len(self.rows)} points within "
                f"{self.max_error:.1%} (allowed {self.tolerance:.0%}); worst: {key} at {worst.request_rate:g} req/s, "
                f"{worst.simulated[key]:.4g} simulated vs {worst.measured[key]:.4g} measured")


def self_check(curve: CapacityCurve, config: SimConfig, requests_per_point: int,
               tolerance: float = TOLERANCE) -> SelfCheck:
    # fewer leave a P99 so noisy that the check would judge the noise, not the simulator
    if requests_per_point < 2000:
        raise ValueError(f"requests_per_point (--self-check-requests): at least 2000 for a P99 within 10%, "
                         f"not {requests_per_point}")
    rows = []
    for i, point in enumerate(curve.points):
        duration = math.ceil(requests_per_point / point.request_rate / config.tick_s) * config.tick_s
        trace = Trace(np.array([0.0, duration]), np.array([point.request_rate] * 2), "steady")
        one = Policy("self-check", None, Pipeline(duration, "latest"), 1)
        result = simulate(curve, trace, one, replace(config, seed=config.seed + i), record_latencies=True)
        simulated = {"throughput": result.num_requests / result.duration_s}
        measured = {"throughput": point.throughput}
        for kind in LATENCIES:
            values = np.concatenate(result.latencies[kind])
            for p, quantile, value in zip(PERCENTILES, np.percentile(values, [50, 90, 99]), point.latency[kind],
                                          strict=True):
                simulated[f"{kind}_{p}"], measured[f"{kind}_{p}"] = float(quantile), value
        rows.append(CheckRow(point.request_rate, measured, simulated))
    return SelfCheck(tuple(rows), tolerance)
