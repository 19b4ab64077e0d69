"""One replica's capacity curve: what a serving pod does at each arrival rate, as measured by
`kvpilot bench serve` against a real server; the fleet simulator's model of a replica.

File format (JSON). Either `kvpilot bench serve --output`'s file (its `runs`), or a list of
points, or `{"description": "...", "points": [...]}`. Each point is one steady load:
* `request_rate` — offered requests/s (a number; "inf", an unbounded run, only shows the
  saturation throughput);
* `request_throughput` — completed requests/s;
* `ttft`, `itl`, `e2e` — latency percentiles in seconds as `{"p50": s, "p90": s, "p99": s}`
  (bench serve's form), or flat in milliseconds: `ttft_p50_ms`, `ttft_p90_ms`, `ttft_p99_ms`,
  and the same for `itl_` and `e2e_`;
* optional, the server's own gauges averaged over the run (what the autoscaler's signals read):
  `kv_cache_usage` (0-1), `num_requests_waiting`, `num_requests_running`, `preemptions_per_s`.
  A gauge must be on every point or on none; a policy whose signal no point carries is skipped.
The replica's *capacity* is the highest throughput a point completed. An unbounded run sends
every request at once, which the replica batches as Poisson arrivals never are, so once a point
at a finite rate completed less than 95% of its rate, only those points count. A point is *saturated*
when it was offered more than that and completed less than 95% of what it was offered: its
latencies grew with the run's length, so only its throughput is used. A run offered less than
the capacity that still completed less than 95% of its rate is not saturated: a finite run
comes short by its last requests' latency (a run of 24 requests, each taking a tenth of the run,
completes about 10% below its rate however idle the server) and by the randomness of its
Poisson arrivals (±20% in the span of 24 arrivals); a steady overload would have shown in the
capacity itself.

Between points every percentile is interpolated linearly in the rate; past the last unsaturated
point the last segment is extended, up to the capacity, past which the simulator queues.
Within a point, a request's latency is drawn from a distribution through the three percentiles:
piecewise linear in -ln(1 - q) (an exponential tail between P90 and P99, extended past P99).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LATENCIES = ("ttft", "itl", "e2e")
GAUGES = ("kv_cache_usage", "num_requests_waiting", "num_requests_running", "preemptions_per_s")
PERCENTILES = ("p50", "p90", "p99")
# -ln(1 - q) at the three percentiles: a request's latency is linear in it between them.
_U = np.array([math.log(2), math.log(10), math.log(100)])
_SATURATED = 0.95


class CurveError(ValueError):
    """A capacity curve file that cannot be used; the message names the point and the key."""


@dataclass(frozen=True)
class CurvePoint:
    request_rate: float
    throughput: float
    latency: dict[str, tuple[float, float, float]]  # LATENCIES -> (p50, p90, p99) seconds
    gauges: dict[str, float]  # the GAUGES the point carries


class CapacityCurve:
    def __init__(self, points: tuple[CurvePoint, ...], capacity: float, description: str) -> None:
        if len(points) < 2:
            raise CurveError(f"a curve needs at least two unsaturated points, not {len(points)}")
        self.points = points  # unsaturated, by rate
        self.capacity = capacity  # requests/s one replica completes at most
        self.description = description
        self.gauges = tuple(g for g in GAUGES if g in points[0].gauges)
        self._rate_list = [p.request_rate for p in points]
        self._table = {k: np.array([p.latency[k] for p in points]) for k in LATENCIES}  # (points, 3)
        self._all = np.stack([self._table[k] for k in LATENCIES], axis=1)  # (points, LATENCIES, 3)
        self._gauges = {g: np.array([p.gauges[g] for p in points]) for g in self.gauges}

    def percentiles(self, kind: str, rate: float) -> np.ndarray:
        """(p50, p90, p99) in seconds at `rate`."""
        return np.maximum(self._interp(self._table[kind], rate), 0.0)

    def latencies(self, rate: float) -> np.ndarray:
        """(LATENCIES, 3): every kind's (p50, p90, p99) at `rate`."""
        return np.maximum(self._interp(self._all, rate), 0.0)

    def gauge(self, name: str, rate: float) -> float:
        value = float(self._interp(self._gauges[name], rate))
        return min(max(value, 0.0), 1.0) if name == "kv_cache_usage" else max(value, 0.0)

    def highest_rate_within(self, ttft_s: float, e2e_s: float | None = None) -> float | None:
        """The highest rate (per replica) up to which P99 TTFT (and P99 E2E) stay within the
        limits, on the curve's interpolation; None if even its lowest point misses them. A noisy
        curve may dip back under the limits past a point that missed them: the first miss counts."""
        def meets(rate: float) -> bool:
            ok = self.percentiles("ttft", rate)[2] <= ttft_s
            return bool(ok and (e2e_s is None or self.percentiles("e2e", rate)[2] <= e2e_s))
        if not meets(self._rate_list[0]):
            return None
        ends = [r for r in self._rate_list if r < self.capacity] + [self.capacity]
        missed = next((i for i, rate in enumerate(ends) if not meets(rate)), None)
        if missed is None:
            return self.capacity
        low, high = (ends[missed - 1] if missed else self._rate_list[0]), ends[missed]
        for _ in range(50):
            mid = (low + high) / 2
            low, high = (mid, high) if meets(mid) else (low, mid)
        return low

    def _interp(self, column: np.ndarray, rate: float) -> np.ndarray:
        """Linear in the rate; held below the first point; the last segment extended past the
        last point, up to the capacity."""
        rates = self._rate_list
        rate = min(max(rate, rates[0]), max(self.capacity, rates[-1]))
        i = min(max(bisect.bisect_left(rates, rate) - 1, 0), len(rates) - 2)
        share = (rate - rates[i]) / (rates[i + 1] - rates[i])
        return column[i] + share * (column[i + 1] - column[i])


def sample(percentiles: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Latencies through (p50, p90, p99) for draws u ~ Exp(1) (u = -ln(1 - q)); `percentiles`
    may stack several kinds, (kinds, 3) -> (kinds, len(u)), all at the same draws."""
    p = np.asarray(percentiles, dtype=np.float64)[..., None]
    low = p[..., 0, :] + (u - _U[0]) * ((p[..., 1, :] - p[..., 0, :]) / (_U[1] - _U[0]))
    high = p[..., 1, :] + (u - _U[1]) * ((p[..., 2, :] - p[..., 1, :]) / (_U[2] - _U[1]))
    return np.maximum(np.where(u < _U[1], low, high), 0.0)


def load_curve(path: Path) -> CapacityCurve:
    try:
        body = json.loads(path.read_text())
    except OSError as e:
        raise CurveError(f"{path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise CurveError(f"{path}: not JSON: {e}") from None
    try:
        return parse_curve(body)
    except CurveError as e:
        raise CurveError(f"{path}: {e}") from None


def parse_curve(body: Any) -> CapacityCurve:
    description = ""
    if isinstance(body, dict):
        description = str(body.get("description", body.get("model", "")))
        entries = body.get("points", body.get("runs"))
    else:
        entries = body
    if not isinstance(entries, list) or not entries:
        raise CurveError("expected a list of points (or an object with 'points' or 'runs')")
    runs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise CurveError(f"point {i}: not an object")
        runs.append((_rate(entry, i), _number(entry, "request_throughput", i)))
    finite = [(rate, throughput) for rate, throughput in runs if not math.isinf(rate)]
    short = any(throughput < _SATURATED * rate for rate, throughput in finite)
    capacity = max(throughput for _, throughput in (finite if short else runs))
    points = []
    for i, (entry, (rate, throughput)) in enumerate(zip(entries, runs, strict=True)):
        if math.isinf(rate) or (rate > capacity and throughput < _SATURATED * rate):
            continue
        latency = {k: _percentiles(entry, k, i) for k in LATENCIES}
        gauges = {g: _number(entry, g, i) for g in GAUGES if entry.get(g) is not None}
        points.append(CurvePoint(rate, throughput, latency, gauges))
    points.sort(key=lambda p: p.request_rate)
    for g in GAUGES:
        having = [p.request_rate for p in points if g in p.gauges]
        if having and len(having) != len(points):
            raise CurveError(f"{g}: on {len(having)} of {len(points)} unsaturated points; give it on all or none")
    if len({p.request_rate for p in points}) != len(points):
        raise CurveError("two unsaturated points have the same request_rate")
    return CapacityCurve(tuple(points), capacity, description)


def _rate(entry: dict[str, Any], i: int) -> float:
    value = entry.get("request_rate")
    if value in ("inf", math.inf):
        return math.inf
    rate = _number(entry, "request_rate", i)
    if rate <= 0:
        raise CurveError(f"point {i}: request_rate must be positive, not {rate}")
    return rate


def _number(entry: dict[str, Any], key: str, i: int) -> float:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise CurveError(f"point {i} (request_rate {entry.get('request_rate')}): {key} must be a "
                         f"non-negative number, not {value!r}")
    return float(value)


def _percentiles(entry: dict[str, Any], kind: str, i: int) -> tuple[float, float, float]:
    nested = entry.get(kind)
    if isinstance(nested, dict):
        values = tuple(_number(nested, p, i) for p in PERCENTILES)
    elif all(f"{kind}_{p}_ms" in entry for p in PERCENTILES):
        values = tuple(_number(entry, f"{kind}_{p}_ms", i) / 1000 for p in PERCENTILES)
    else:
        raise CurveError(f"point {i} (request_rate {entry.get('request_rate')}): {kind} needs p50, p90 and p99, "
                         f"as {kind}: {{p50, p90, p99}} in seconds or {kind}_p50_ms, {kind}_p90_ms, {kind}_p99_ms")
    if not values[0] <= values[1] <= values[2]:
        raise CurveError(f"point {i} (request_rate {entry.get('request_rate')}): {kind} percentiles must not "
                         f"decrease, not {values}")
    return values  # type: ignore[return-value]
