"""`mode: builtin`: the replicas an InferenceService should have, as a pure function of its pods'
windows, the replicas in force, `spec.autoscaling` and the state the last decision returned.

The steps are the HPA controller's (`calculator.py`, then `behavior.py`), so builtin, hpa and keda
scale alike on the same signal; what builtin adds is the signal itself: the operator's own
scrapes of every pod (no Prometheus, no adapter, no lag beyond one scrape), means over a window,
and a service-wide P99 TTFT from merged histograms.

How the operator calls it, every `spec.interval` seconds, for an InferenceService with
`spec.autoscaling.enabled` and `mode: builtin`:

    decision = decide_replicas(scraper.summaries(since=now - spec.window), pods, replicas, spec,
                               state, now=now)
    if decision.desired != decision.current:   # write spec.replicas through the scale subresource
        state = decision.scaled_state          # once the write succeeded
    else:
        state = decision.state

`pods` maps every pod of the service to ready | starting | leaving (`calculator.py`);
`replicas` is `spec.replicas` as the scale subresource reports it. The scraper must scrape at
least every `interval` and keep `window + interval` seconds of samples.

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
from .calculator import PER_POD, Estimate, PodState, estimate
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

    @property
    def direction(self) -> Literal["up", "down"] | None:
        """The `direction` label of kvpilot_operator_scaling_decisions_total; None: no change."""
        if self.desired == self.current:
            return None
        return "up" if self.desired > self.current else "down"


def decide_replicas(summaries: Mapping[str, WindowSummary], pods: Mapping[str, PodState], current: int,
                    spec: ScalingSpec, state: ScalerState, *, now: float) -> ScaleDecision:
    """`summaries`: each pod's window over (now - spec.window, now], by pod name."""

    def decision(desired: int, code: str, reason: str, new_state: ScalerState,
                 value: float | None = None) -> ScaleDecision:
        return ScaleDecision(now, current, desired, spec.metric, value, spec.target, code, reason, new_state,
                             new_state.scaled(now, current, desired, spec.behavior))

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
    n = normalize(est.replicas, current, spec.min_replicas, spec.max_replicas, spec.behavior, state, now)
    unreachable = out_of_reach(summaries, pods, spec)
    if unreachable is not None and n.replicas <= current:
        # kvpilot's one departure from the HPA: a service whose requests queue is not scaled down
        held = "" if n.replicas == current else " (no scale-down while requests queue)"
        return decision(current, "TargetUnreachable",
                        f"{unreachable}; {_reason(spec, est, current, current, n.note)}{held}", n.state, est.value)
    return decision(n.replicas, n.code, _reason(spec, est, current, n.replicas, n.note), n.state, est.value)


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
    waiting = fmean(s.num_waiting_seqs for s in ready)
    value = fmean(PER_POD[spec.metric](s) for s in ready)
    if waiting < QUEUEING_PER_POD or value >= spec.target * (1 - spec.tolerance):
        return None
    return (f"{spec.metric} target {_format(spec.metric, spec.target)} is out of the pods' reach: "
            f"{_format(spec.metric, value)} while {waiting:.1f} requests wait per pod, so the queue grows "
            f"and nothing scales up; set the target to the value the pods show at the load each should "
            f"carry (kvpilot bench serve measures it)")


def _reason(spec: ScalingSpec, est: Estimate, current: int, desired: int, note: str) -> str:
    head = (f"{spec.metric} {_format(spec.metric, est.value)} ({est.basis}) vs target "
            f"{_format(spec.metric, spec.target)}: ratio {est.ratio:.2f}")
    if est.replicas == current and abs(1 - est.ratio) <= spec.tolerance:
        return f"{head}, within tolerance {spec.tolerance:g}: {current} replicas stay"
    asks = f"{head} asks for {est.replicas}"
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
