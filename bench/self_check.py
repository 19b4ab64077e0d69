"""The simulator's own check: one simulated replica, offered each rate of the capacity curve,
must give back the curve's P50/P90/P99 TTFT, ITL and E2E and its throughput, each within
`tolerance` (10%). It checks the parts between the curve and the results (the interpolation,
the latency draws, the arrivals, the queue), not the curve itself.

Each is compared with what was measured the way it was measured:
* the percentiles, with a long steady Poisson run of the fleet simulator (`requests_per_point`
  requests), since a P99 of a few hundred draws would judge the noise;
* the throughput, when the point records its run (`num_requests`, `duration_s`, as `kvpilot
  bench serve` writes them), with the same finite run from an idle replica: its number of
  requests at its rate, counted as bench serve counts it, requests / (first send to last
  answer), so its arrival span and its last requests' latency count as they did. The arrivals
  are the run's own when the file says how bench serve drew them (`workload.seed`,
  `burstiness`), else Poisson draws; the mean over `requests_per_point / num_requests` runs.
  The replica is the fleet simulator's: a request's E2E drawn at the point's load (every
  unsaturated point lies at or below the capacity, so no queue forms), served on its clock;
  once the last request is sent, the replica drains as a removed one does (`fleet.drain_s`),
  so the run's tail is the simulator's drain. A point without its run (a steady rate's
  throughput) is compared with the steady run's requests / duration.
A steady simulation's throughput is its offered rate, a finite run's falls short of it by its
span and tail (benchmarks/history/2026-12-04.md, "Fleet simulation on the H200 curve"):
comparing those two would fail by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kvpilot.bench import fleet
from kvpilot.bench.arrival_trace import Trace
from kvpilot.bench.capacity_curve import LATENCIES, PERCENTILES, CapacityCurve, CurvePoint
from kvpilot.bench.fleet import simulate
from kvpilot.bench.fleet_inputs import Pipeline, Policy, SimConfig
from kvpilot.bench.percentile import percentile

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
        one = Policy("self-check", None, Pipeline(duration), 1)
        result = simulate(curve, trace, one, replace(config, seed=config.seed + i), record_latencies=True)
        if point.num_requests is None:
            simulated = {"throughput": result.num_requests / result.duration_s}
        else:
            simulated = {"throughput": finite_run_throughput(curve, point, requests_per_point,
                                                             np.random.default_rng([config.seed, i]))}
        measured = {"throughput": point.throughput}
        for kind in LATENCIES:
            values = np.concatenate(result.latencies[kind])
            for p, value in zip(PERCENTILES, point.latency[kind], strict=True):
                simulated[f"{kind}_{p}"], measured[f"{kind}_{p}"] = percentile(values, float(p[1:])), value
        rows.append(CheckRow(point.request_rate, measured, simulated))
    return SelfCheck(tuple(rows), tolerance)


def finite_run_throughput(curve: CapacityCurve, point: CurvePoint, requests: int, rng: np.random.Generator) -> float:
    """bench serve's throughput of the point's run, simulated: num_requests / (the last answer's
    time from the first send), the mean over `requests / num_requests` runs (at least one)."""
    from kvpilot.bench.loadgen import arrival_times

    n = point.num_requests
    assert n is not None
    replayed = None
    if curve.arrivals is not None:
        seed, burstiness = curve.arrivals
        replayed = arrival_times(n, point.request_rate, burstiness, np.random.default_rng(seed))
    e2e = curve.percentiles("e2e", point.request_rate)
    unit = fleet.e2e_p50(curve, point.request_rate)  # the clock reads time / unit while requests arrive
    throughputs = []
    for _ in range(max(1, requests // n)):
        sent = replayed if replayed is not None else arrival_times(n, point.request_rate, 1.0, rng)
        last = float(sent[-1])
        work = float(np.max((sent + fleet.sample(e2e, rng.exponential(size=n))) / unit)) - last / unit
        throughputs.append(n / (last + fleet.drain_s(curve, work, 0.0)))
    return float(np.mean(throughputs))
