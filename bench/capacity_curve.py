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
A finite run never completes its full rate, so completed/offered cannot tell saturation: a run of N
requests lasts its arrival span plus its last requests' latency, and its span is random (a run
of 24 Poisson arrivals comes about ±20% off its rate by its arrivals alone). A point is *saturated* when it shows what a saturated server
shows, a queue that builds over the run instead of a first token at the unsaturated speed:
* its mean `num_requests_waiting` reaches a quarter of the unbounded run's (when both carry it and
  the unbounded run queued at all). A run offered λ over a capacity μ ends its arrivals with
  N(1 - μ/λ) queued, so it holds about N(1 - μ/λ)/2 on average, against about N/2 less a batch
  for the unbounded run: a quarter marks a rate about a third above the capacity, which a
  server's admission delay alone (a request waiting for the next step) does not reach; or
* its TTFT P50 is more than 10 times the lowest-rate point's: a queue's wait, not prefill, makes
  the first token (for curves without the gauge or an unbounded run).
A saturated point's latencies grew with the run's length, so only its throughput is used.
The replica's *capacity*: when no finite run saturated, the unbounded run's throughput (what the
replica completes with every request queued), but never less than the highest rate a finite run
kept up with, which it served; when one did, the unbounded run's one batched burst (which Poisson
arrivals never give) does not count: the highest of the kept-up rates and the saturated runs'
throughputs. Every unsaturated point is thus at or below the capacity.
A point from `kvpilot bench serve` also carries `num_requests` and `duration_s` (first send to
last answer), and the file its `workload` (`seed`, `burstiness`, `max_concurrency`), from which
the self-check replays the run's very arrivals (`bench/loadgen.py`'s `arrival_times`).

Between points every percentile is interpolated linearly in the rate; past the last unsaturated
point the last segment is extended up to the capacity, past which the simulator queues, where it
rises (a falling last segment, noise, is held at the last point: latency does not fall with load).
Within a point, a request's latency is drawn from a distribution through the three percentiles:
piecewise linear in -ln(1 - q) (an exponential tail between P90 and P99, extended past P99).
"""

from __future__ import annotations

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
_QUEUE_SHARE = 0.25  # of the unbounded run's mean waiting requests
_TTFT_FACTOR = 10.0  # times the lowest-rate point's TTFT P50


class CurveError(ValueError):
    """A capacity curve file that cannot be used; the message names the point and the key."""


@dataclass(frozen=True)
class CurvePoint:
    request_rate: float
    throughput: float
    latency: dict[str, tuple[float, float, float]]  # LATENCIES -> (p50, p90, p99) seconds
    gauges: dict[str, float]  # the GAUGES the point carries
    num_requests: int | None = None  # the run's requests, and first send to last answer (bench serve's)
    duration_s: float | None = None


class CapacityCurve:
    def __init__(self, points: tuple[CurvePoint, ...], capacity: float, description: str,
                 arrivals: tuple[int, float] | None = None) -> None:
        if len(points) < 2:
            raise CurveError(f"a curve needs at least two unsaturated points, not {len(points)}")
        self.points = points  # unsaturated, by rate
        self.capacity = capacity  # requests/s one replica completes at most
        self.description = description
        self.arrivals = arrivals  # bench serve's (seed, burstiness): its runs' arrival times replay
        self.gauges = tuple(g for g in GAUGES if g in points[0].gauges)
        self._rate_list = [p.request_rate for p in points]
        self._rates = np.array(self._rate_list)
        self._table = {k: np.array([p.latency[k] for p in points]) for k in LATENCIES}  # (points, 3)
        self._all = np.stack([self._table[k] for k in LATENCIES], axis=1)  # (points, LATENCIES, 3)
        self._gauges = {g: np.array([p.gauges[g] for p in points]) for g in self.gauges}

    def percentiles(self, kind: str, rate: float) -> np.ndarray:
        """(p50, p90, p99) in seconds at `rate`."""
        return self.latencies_at(np.array([rate]))[0, LATENCIES.index(kind)]

    def latencies(self, rate: float) -> np.ndarray:
        """(LATENCIES, 3): every kind's (p50, p90, p99) at `rate`."""
        return self.latencies_at(np.array([rate]))[0]

    def latencies_at(self, rates: np.ndarray) -> np.ndarray:
        """(len(rates), LATENCIES, 3): the same at each of `rates`."""
        return np.maximum(self._interp(self._all, rates), 0.0)

    def gauge(self, name: str, rate: float) -> float:
        return float(self.gauge_at(name, np.array([rate]))[0])

    def gauge_at(self, name: str, rates: np.ndarray) -> np.ndarray:
        value = np.maximum(self._interp(self._gauges[name], rates), 0.0)
        return np.minimum(value, 1.0) if name == "kv_cache_usage" else value

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

    def _interp(self, column: np.ndarray, rates: np.ndarray) -> np.ndarray:
        """`column` (points, ...) at each of `rates`: linear in the rate; held below the first
        point; the last segment extended past the last point, up to the capacity."""
        known = self._rates
        x = np.minimum(np.maximum(rates, known[0]), max(self.capacity, known[-1]))
        i = np.clip(np.searchsorted(known, x, side="left") - 1, 0, len(known) - 2)
        shape = x.shape + (1,) * (column.ndim - 1)
        share = ((x - known[i]) / (known[i + 1] - known[i])).reshape(shape)
        value = column[i] + share * (column[i + 1] - column[i])
        return np.where((x > known[-1]).reshape(shape), np.maximum(value, column[-1]), value)


def sample(percentiles: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Latencies through (p50, p90, p99) for draws u ~ Exp(1) (u = -ln(1 - q)): `percentiles`
    is (..., 3), its leading shape broadcast against u's, e.g. (3,) for every draw alike or
    (kinds, len(u), 3) for each draw its own, several kinds at the same draws."""
    p = np.asarray(percentiles, dtype=np.float64)
    low = p[..., 0] + (u - _U[0]) * ((p[..., 1] - p[..., 0]) / (_U[1] - _U[0]))
    high = p[..., 1] + (u - _U[1]) * ((p[..., 2] - p[..., 1]) / (_U[2] - _U[1]))
    return np.maximum(np.where(u < _U[1], low, high), 0.0)


def share_within(percentiles: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """The share of `sample`'s draws at most `limit` (P(latency <= limit)), `percentiles` (..., 3)
    broadcast against `limit`: `sample` inverted, the draw u whose latency is the limit, as
    1 - exp(-u)."""
    p = np.asarray(percentiles, dtype=np.float64)
    p0, p1, p2 = p[..., 0], p[..., 1], p[..., 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        low = _U[0] + (limit - p0) * ((_U[1] - _U[0]) / (p1 - p0))  # inf past a flat segment
        high = _U[1] + (limit - p1) * ((_U[2] - _U[1]) / (p2 - p1))
    u = np.where(limit < p1, np.where(p1 > p0, low, 0.0), np.where(p2 > p1, high, np.inf))
    return np.where(limit < 0, 0.0, -np.expm1(-np.maximum(u, 0.0)))


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
    saturated = _saturated(entries, runs)
    kept_up = [rate for i, (rate, _) in enumerate(runs) if not math.isinf(rate) and i not in saturated]
    if saturated:
        capacity = max(kept_up + [runs[i][1] for i in saturated])
    else:
        capacity = max(kept_up + [throughput for rate, throughput in runs if math.isinf(rate)])
    points = []
    for i, (entry, (rate, throughput)) in enumerate(zip(entries, runs, strict=True)):
        if math.isinf(rate) or i in saturated:
            continue
        latency = {k: _percentiles(entry, k, i) for k in LATENCIES}
        gauges = {g: _number(entry, g, i) for g in GAUGES if entry.get(g) is not None}
        num_requests = int(_number(entry, "num_requests", i)) if entry.get("num_requests") is not None else None
        duration = _number(entry, "duration_s", i) if entry.get("duration_s") is not None else None
        if (num_requests is None) != (duration is None) or num_requests == 0 or duration == 0:
            raise CurveError(f"point {i} (request_rate {entry.get('request_rate')}): num_requests and duration_s "
                             f"go together and must be positive, not {num_requests!r} and {duration!r}")
        points.append(CurvePoint(rate, throughput, latency, gauges, num_requests, duration))
    points.sort(key=lambda p: p.request_rate)
    for g in GAUGES:
        having = [p.request_rate for p in points if g in p.gauges]
        if having and len(having) != len(points):
            raise CurveError(f"{g}: on {len(having)} of {len(points)} unsaturated points; give it on all or none")
    if len({p.request_rate for p in points}) != len(points):
        raise CurveError("two unsaturated points have the same request_rate")
    return CapacityCurve(tuple(points), capacity, description, _arrivals(body))


def _saturated(entries: list[dict[str, Any]], runs: list[tuple[float, float]]) -> set[int]:
    """The finite-rate points that show a saturated server's queue (the module's rule)."""
    finite = [i for i, (rate, _) in enumerate(runs) if not math.isinf(rate)]
    if not finite:
        return set()
    unbounded = [_number(entries[i], "num_requests_waiting", i) for i, (rate, _) in enumerate(runs)
                 if math.isinf(rate) and entries[i].get("num_requests_waiting") is not None]
    queue_limit = _QUEUE_SHARE * max(unbounded) if unbounded and max(unbounded) > 0 else None
    lowest = min(finite, key=lambda i: runs[i][0])
    ttft_limit = _TTFT_FACTOR * _percentiles(entries[lowest], "ttft", lowest)[0]
    saturated = set()
    for i in finite:
        waiting = entries[i].get("num_requests_waiting")
        if queue_limit is not None and waiting is not None and _number(entries[i], "num_requests_waiting", i) >= queue_limit:
            saturated.add(i)
        elif ttft_limit > 0 and _percentiles(entries[i], "ttft", i)[0] > ttft_limit:  # 0: no scale to judge by
            saturated.add(i)
    return saturated


def _arrivals(body: Any) -> tuple[int, float] | None:
    """bench serve's (seed, burstiness), when its runs' arrival times can be replayed: not under a
    concurrency limit, which delays sends past their arrival times."""
    workload = body.get("workload") if isinstance(body, dict) else None
    if not isinstance(workload, dict) or workload.get("max_concurrency") is not None:
        return None
    seed, burstiness = workload.get("seed"), workload.get("burstiness", 1.0)
    if isinstance(seed, bool) or not isinstance(seed, int) or isinstance(burstiness, bool) \
            or not isinstance(burstiness, int | float) or not burstiness > 0:
        raise CurveError(f"workload: seed must be an integer and burstiness positive, not {seed!r} and {burstiness!r}")
    return seed, float(burstiness)


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
