"""`mode: builtin`: the replicas an InferenceService should have, as a pure function of its pods'
windows, the replicas in force, `spec.autoscaling` and the state the last decision returned.

The steps are the HPA controller's (`calculator.py`, then `behavior.py`), so builtin, hpa and keda
scale alike on the same signal; what builtin adds is the signal itself: the operator's own
scrapes of every pod (no Prometheus, no adapter, no lag beyond one scrape), means over a window,
and a service-wide P99 TTFT from merged histograms.

How the operator calls it, every `spec.interval` seconds, for an InferenceService with
`spec.autoscaling.enabled` and `mode: builtin`:

    decision = decide_replicas(scraper.summaries(since=now - spec.window), pods, replicas, spec,
                               state, now=now, forecast=forecast)
    if decision.desired != decision.current:   # write spec.replicas through the scale subresource
        state = decision.scaled_state          # once the write succeeded
    else:
        state = decision.state

`pods` maps every pod of the service to ready | starting | leaving (`calculator.py`);
`replicas` is `spec.replicas` as the scale subresource reports it; `forecast` the arrival rate's
trend one start-up plus one interval ahead (`forecast.py`; None: scale on the present alone). A
forecast rise asks for the replicas the forecast load needs at the pods' present load per unit of
the metric, when that is more than the estimate and beyond the tolerance; it never scales down.
The scraper must scrape at least every `interval` and keep `window + interval` seconds of samples.

`out_of_reach` is what the HPA does not tell: a target on KV-cache usage or preemptions that the
pods do not reach even while requests queue at them. Such a service never scales up however long
its queue: what the serving-engine rule of a 0.85 KV-cache usage gives on a GPU whose cache
is large for its load. The decision says so (code `TargetUnreachable`), and, unlike the HPA,
does not scale such a service down while its requests queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from statistics import fmean
from typing import Literal

from ..autotune.window import WindowSummary
from .behavior import ScalerState, normalize
from .calculator import PER_POD, Estimate, PodState, ceil_replicas, estimate
from .forecast import Forecast, pod_rate
from .scaling_spec import Metric, ScalingSpec


@dataclass(frozen=True)
class ScaleDecision:
    time: float
    current: int
    desired: int
    metric: Metric
    value: float | None  # the metric as the decision saw it; None without data
    target: float
    code: str  # the HPA's condition reason: DesiredWithinRange, ScaleUpLimit, ScaleDownStabilized...
    reason: str  # the values behind the decision, for status and Events
    state: ScalerState  # keep this when the replicas were not written
    scaled_state: ScalerState  # keep this once the replicas were written from current to desired
    forecast: Forecast | None = None  # the arrival rate's trend the decision read

    @property
    def direction(self) -> Literal["up", "down"] | None:
        """The `direction` label of kvpilot_operator_scaling_decisions_total; None: no change."""
        if self.desired == self.current:
            return None
        return "up" if self.desired > self.current else "down"


def decide_replicas(summaries: Mapping[str, WindowSummary], pods: Mapping[str, PodState], current: int,
                    spec: ScalingSpec, state: ScalerState, *, now: float,
                    forecast: Forecast | None = None) -> ScaleDecision:
    """`summaries`: each pod's window over (now - spec.window, now], by pod name."""

    def decision(desired: int, code: str, reason: str, new_state: ScalerState,
                 value: float | None = None) -> ScaleDecision:
        return ScaleDecision(now, current, desired, spec.metric, value, spec.target, code, reason, new_state,
                             new_state.scaled(now, current, desired, spec.behavior), forecast)

    if current == 0:
        # As the HPA: a target scaled to zero by hand is left alone until it is scaled up by hand.
        return decision(0, "ScalingDisabled", "replicas is 0: autoscaling resumes once it is scaled up", state)
    if current > spec.max_replicas:
        return decision(spec.max_replicas, "TooManyReplicas",
                        f"{current} replicas is above maxReplicas {spec.max_replicas}", state)
    if current < spec.min_replicas:
        return decision(spec.min_replicas, "TooFewReplicas",
                        f"{current} replicas is below minReplicas {spec.min_replicas}", state)
    est = estimate(spec.metric, summaries, pods, current, spec.target, spec.tolerance)
    if isinstance(est, str):
        return decision(current, "NoMetrics", f"{spec.metric}: {est}: {current} replicas stay", state)
    ahead = replicas_ahead(forecast, est, summaries, pods, current, spec)
    wanted = est.replicas if ahead is None else ahead
    n = normalize(wanted, current, spec.min_replicas, spec.max_replicas, spec.behavior, state, now)
    unreachable = out_of_reach(summaries, pods, spec)
    if unreachable is not None and n.replicas <= current:
        # kvpilot's one departure from the HPA: a service whose requests queue is not scaled down
        held = "" if n.replicas == current else " (no scale-down while requests queue)"
        reason = _reason(spec, est, current, current, n.note, forecast, ahead)
        return decision(current, "TargetUnreachable", f"{unreachable}; {reason}{held}", n.state, est.value)
    return decision(n.replicas, n.code, _reason(spec, est, current, n.replicas, n.note, forecast, ahead), n.state,
                    est.value)


def replicas_ahead(forecast: Forecast | None, est: Estimate, summaries: Mapping[str, WindowSummary],
                   pods: Mapping[str, PodState], current: int, spec: ScalingSpec) -> int | None:
    """The replicas the forecast load needs, when a significant rise asks for more than both the
    estimate and the replicas in force beyond the tolerance; else None. A pod's load at the target
    is its window's arrival rate over the metric's ratio to the target, so the replicas needed are
    the forecast rate times that ratio over the rate per pod."""
    per_pod = pod_rate(summaries, pods)
    if forecast is None or not forecast.significant or per_pod is None or per_pod <= 0:
        return None
    needed = forecast.rate_ahead * (est.value / spec.target) / per_pod
    if needed <= current * (1 + spec.tolerance):
        return None
    replicas = ceil_replicas(needed)
    return replicas if replicas > max(est.replicas, current) else None


# mean requests waiting per ready pod over the window from which a service counts as queueing
QUEUEING_PER_POD = 1.0


def out_of_reach(summaries: Mapping[str, WindowSummary], pods: Mapping[str, PodState],
                 spec: ScalingSpec) -> str | None:
    """Why `spec.target` looks beyond what the pods reach, or None: the per-pod mean stays below
    the target by more than the tolerance while requests queue at the pods (a mean of at least
    `QUEUEING_PER_POD` waiting), on a metric that does not itself grow with the queue."""
    if spec.metric not in ("kvCacheUsage", "preemptionRate"):
        return None
    ready = [s for p, s in summaries.items() if pods.get(p) == "ready"]
    if not ready:
        return None
    waiting = fmean(s.num_requests_waiting for s in ready)
    value = fmean(PER_POD[spec.metric](s) for s in ready)
    if waiting < QUEUEING_PER_POD or value >= spec.target * (1 - spec.tolerance):
        return None
    return (f"{spec.metric} target {_format(spec.metric, spec.target)} is out of the pods' reach: "
            f"{_format(spec.metric, value)} while {waiting:.1f} requests wait per pod, so the queue grows "
            f"and nothing scales up; set the target to the value the pods show at the load each should "
            f"carry (kvpilot bench serve measures it)")


def _reason(spec: ScalingSpec, est: Estimate, current: int, desired: int, note: str, forecast: Forecast | None,
            ahead: int | None) -> str:
    head = (f"{spec.metric} {_format(spec.metric, est.value)} ({est.basis}) vs target "
            f"{_format(spec.metric, spec.target)}: ratio {est.ratio:.2f}")
    if ahead is None and est.replicas == current and abs(1 - est.ratio) <= spec.tolerance:
        return f"{head}, within tolerance {spec.tolerance:g}: {current} replicas stay"
    asks = f"{head} asks for {est.replicas}"
    if ahead is not None and forecast is not None:
        asks = f"{asks}; {forecast.describe()} asks for {ahead}"
    if note:
        asks = f"{asks}; {note}"
    outcome = f"{current} -> {desired} replicas" if desired != current else f"{current} replicas stay"
    return f"{asks}: {outcome}"


def _format(metric: Metric, value: float) -> str:
    if metric == "kvCacheUsage":
        return f"{value:.2f}"
    if metric == "waitingPerReplica":
        return f"{value:.1f}"
    if metric == "preemptionRate":
        return f"{value:.2f}/s"
    return f"{value:.3f} s"
