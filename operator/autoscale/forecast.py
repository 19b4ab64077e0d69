"""Predictive scale-up (`mode: builtin`): a trend forecast of the service's arrival rate, so that
replicas asked for now are Ready when the load that needs them arrives.

Terms:
* *arrival rate* — requests per second reaching the service. A pod's over a window is the
  requests it finished plus the change in those it holds (running and waiting), which is every
  request it received except those aborted before finishing (`WindowSummary.arrivals_per_s`);
  the service's is the sum over the ready pods (`service_rate`), known only when each has a
  window: a pod Ready for less than one has served a share no window shows, and the others' mean
  is of a load split among fewer pods, so that pass adds no point.
* *rate series* — one point per pilot pass: the service's arrival rate over the interval since
  the previous pass (`RateSeries`).
* *horizon* — how far ahead the forecast looks: the service's measured start-up (created to
  Ready, `startup.py`) plus one interval, as a replica asked for now serves from then on.
* *trend* — the least-squares line through the points of the last `lookback` seconds. It counts
  only when its slope is positive with 99% confidence (a one-sided t-test on the line's
  residuals, each point's variance at least a Poisson count's): the noise of a flat rate passes
  it on at most about one pass in a hundred, and a rise it misses is one the points barely show.

How the policy uses it (`policy.decide_replicas`): the metric tells how loaded the pods are
against their target (its ratio), the arrival rate over the same window how much load that is,
so a pod's load at its target is (the window's rate per pod) / ratio, and the replicas the
forecast load needs are the forecast rate over that. Scale-up takes the larger of that and the
reactive estimate; scale-down never reads the forecast (it stays reactive, and `behavior`'s
scale-down stabilisation holds it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from statistics import fmean, linear_regression

from ..autotune.window import WindowSummary
from .calculator import PodState
from .scaling_spec import ScalingSpec

MIN_POINTS = 4  # a line through fewer has too few degrees of freedom to judge its slope by
# Student's t at 0.99 (one-sided) by degrees of freedom (points - 2); the last beyond
_T99 = (31.821, 6.965, 4.541, 3.747, 3.365, 3.143, 2.998, 2.896, 2.821, 2.764, 2.718, 2.681, 2.650, 2.624,
        2.602, 2.583, 2.567, 2.552, 2.539, 2.528)


@dataclass(frozen=True)
class RatePoint:
    time: float  # seconds since the epoch: the end of the interval
    rate: float  # requests/s over the interval


@dataclass(frozen=True)
class RateSeries:
    """The service's arrival rate, one point per pass, oldest first; a new value after each pass."""

    points: tuple[RatePoint, ...] = ()

    def observed(self, time: float, rate: float | None, keep_s: float) -> RateSeries:
        """With the pass at `time` added (None: the rate is not known this pass) and the points
        older than `keep_s` dropped."""
        kept = tuple(p for p in self.points if p.time > time - keep_s and p.time < time)
        return replace(self, points=kept if rate is None else (*kept, RatePoint(time, rate)))


@dataclass(frozen=True)
class Forecast:
    rate_now: float  # the trend's level now (req/s)
    rate_ahead: float  # at now + horizon_s; never below rate_now
    horizon_s: float
    slope: float  # req/s per second, as fitted
    num_points: int
    significant: bool  # the slope above 0 with 99% confidence

    def describe(self) -> str:
        verdict = "rising" if self.significant else "no significant rise"
        return (f"arrival rate {self.rate_now:.3g} req/s, {verdict} ({self.slope:+.3g} req/s per s over "
                f"{self.num_points} points): {self.rate_ahead:.3g} req/s forecast {self.horizon_s:.0f} s ahead")


def forecast(series: RateSeries, now: float, horizon_s: float, lookback_s: float) -> Forecast | None:
    """The trend of the points within `lookback_s` of `now`, extrapolated `horizon_s` ahead;
    None with fewer than MIN_POINTS points. Without a significant rise the forecast is the level
    now: a falling or flat trend never forecasts less than the present."""
    if horizon_s < 0 or lookback_s <= 0:
        raise ValueError(f"horizon_s must be >= 0 and lookback_s positive, not {horizon_s} and {lookback_s}")
    points = [p for p in series.points if p.time > now - lookback_s]
    if len(points) < MIN_POINTS:
        return None
    times = [p.time - now for p in points]  # around 0, so the intercept is the level now
    rates = [p.rate for p in points]
    if len(set(times)) < 2:
        return None
    slope, intercept = linear_regression(times, rates)
    level = max(intercept, 0.0)
    mean_t = fmean(times)
    spread = sum((t - mean_t) ** 2 for t in times)
    residual = sum((r - (intercept + slope * t)) ** 2 for t, r in zip(times, rates, strict=True))
    # a point is a count over its interval, so its variance is at least Poisson's: four points
    # that happen to lie on a line do not make a slope certain
    poisson = fmean(rates) / ((times[-1] - times[0]) / (len(times) - 1))
    error = math.sqrt(max(residual / (len(points) - 2), poisson) / spread)
    significant = slope > 0 and slope > _T99[min(len(points) - 2, len(_T99)) - 1] * error
    ahead = level + slope * horizon_s if significant else level
    return Forecast(level, max(ahead, level), horizon_s, slope, len(points), significant)


def look_ahead(series: RateSeries, recent: Mapping[str, WindowSummary], pods: Mapping[str, PodState],
               now: float, spec: ScalingSpec, startup_s: float | None) -> tuple[RateSeries, Forecast | None]:
    """One pass: the series with the service's arrival rate over `recent` (each pod's window
    since the last pass) added, and the forecast `spec.horizon(startup_s)` ahead (None: the
    spec does not forecast, no start-up was measured yet, or too few points)."""
    if spec.forecast is None:
        return series, None
    series = series.observed(now, service_rate(recent, pods), keep_s=spec.forecast.lookback_s)
    horizon = spec.horizon(startup_s)
    return series, None if horizon is None else forecast(series, now, horizon, spec.forecast.lookback_s)


def service_rate(summaries: Mapping[str, WindowSummary], pods: Mapping[str, PodState]) -> float | None:
    """The service's arrival rate over the summaries' span: the ready pods' summed; None unless
    every ready pod has a window."""
    ready = [p for p, state in pods.items() if state == "ready"]
    if not ready or any(p not in summaries for p in ready):
        return None
    return sum(summaries[p].arrivals_per_s for p in ready)


def pod_rate(summaries: Mapping[str, WindowSummary], pods: Mapping[str, PodState]) -> float | None:
    """The mean arrival rate per ready pod with a window: the load behind the metric's value."""
    rates = [s.arrivals_per_s for p, s in summaries.items() if pods.get(p) == "ready"]
    return fmean(rates) if rates else None
