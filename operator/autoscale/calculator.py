"""How many replicas a metric asks for: the HPA controller's replica calculator, applied to the
operator's scraped windows.

Pod states, as the operator sees them: *ready* (in the Service's endpoints, so scraped),
*starting* (created, not Ready yet: scheduled, pulling its image, loading the model) and
*leaving* (being deleted, or failed). For a per-pod metric the HPA's rules are followed
(`calcPlainMetricReplicas` in kube-controller-manager's replica calculator):
* leaving pods are ignored;
* ready pods without a window (*missing*: just became Ready, or their scrapes failed) are left
  out of a first estimate; then assumed at the target if it scales down, at 0 if it scales up;
* starting pods (the HPA's *unready*) are left out too, and assumed at 0 when the first estimate
  scales up, which damps a scale-up while the pods of the previous one still load their model;
* when those assumptions reverse the direction or bring the ratio within the tolerance, the
  replicas stay.
One deviation: the HPA counts a not-Ready pod in phase Running as ready if it has metrics; a
kvpilot pod that is not Ready is loading its model, serves nothing and is never scraped, so it
always counts as starting.

A service-wide value (ttftP99) follows the HPA's rule for an Object metric: the ratio to the
target times the ready pods, unless within the tolerance. Its value is the P99 of the ready pods'
TTFT histograms merged. A service that finished no request in the window has no P99: if no pod
held a request either, the service is idle and the value is taken as 0 (so an idle service can
scale down, where an HPA would see no data and hold); otherwise the replicas stay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import fmean
from typing import Literal

from ..autotune.sample import Histogram
from ..autotune.window import WindowSummary
from .scaling_spec import Metric

PodState = Literal["ready", "starting", "leaving"]

PER_POD = {
    "kvCacheUsage": lambda s: s.kv_cache_usage,
    "waitingPerReplica": lambda s: s.num_requests_waiting,
    "preemptionRate": lambda s: s.preemptions_per_s,
}


@dataclass(frozen=True)
class Estimate:
    replicas: int  # before stabilisation, rate limits and bounds
    value: float  # the per-pod mean or the service's value the ratio came from
    ratio: float  # to the target, after what was assumed for missing and starting pods
    basis: str  # where the value came from, for the reason


def estimate(metric: Metric, summaries: Mapping[str, WindowSummary], pods: Mapping[str, PodState],
             current: int, target: float, tolerance: float) -> Estimate | str:
    """The replicas `metric` asks for, or why it asks for nothing (no data: the replicas stay)."""
    ready = {p: s for p, s in summaries.items() if pods.get(p) == "ready"}
    if metric == "ttftP99":
        return _service_estimate(ready, pods, current, target, tolerance)
    values = {p: PER_POD[metric](s) for p, s in ready.items()}
    return _per_pod_estimate(values, pods, current, target, tolerance)


def _per_pod_estimate(values: Mapping[str, float], pods: Mapping[str, PodState], current: int,
                      target: float, tolerance: float) -> Estimate | str:
    unready = [p for p, state in pods.items() if state == "starting"]
    missing = [p for p, state in pods.items() if state == "ready" and p not in values]
    if not values:
        return f"no ready pod has a window yet ({len(missing)} ready, {len(unready)} starting)"
    mean = fmean(values.values())
    ratio = mean / target
    basis = f"mean of {_count(len(values), 'ready pod')}"
    rebalance_unready = bool(unready) and ratio > 1
    if not rebalance_unready and not missing:
        if abs(1 - ratio) <= tolerance:
            return Estimate(current, mean, ratio, basis)
        return Estimate(ceil_replicas(ratio * len(values)), mean, ratio, basis)
    filled = list(values.values())
    notes = []
    if missing:
        fill = target if ratio < 1 else 0.0
        filled += [fill] * len(missing)
        notes.append(f"{_count(len(missing), 'pod')} without a window assumed at {fill:g}")
    if rebalance_unready:
        filled += [0.0] * len(unready)
        notes.append(f"{_count(len(unready), 'starting pod')} assumed at 0")
    new_ratio = fmean(filled) / target
    basis = f"{basis}; {', '.join(notes)}"
    reversed_direction = (ratio < 1 < new_ratio) or (ratio > 1 > new_ratio)
    if abs(1 - new_ratio) <= tolerance or reversed_direction:
        return Estimate(current, mean, new_ratio, basis)
    replicas = ceil_replicas(new_ratio * len(filled))
    if (new_ratio < 1 and replicas > current) or (new_ratio > 1 and replicas < current):
        return Estimate(current, mean, new_ratio, basis)
    return Estimate(replicas, mean, new_ratio, basis)


def _service_estimate(ready: Mapping[str, WindowSummary], pods: Mapping[str, PodState], current: int,
                      target: float, tolerance: float) -> Estimate | str:
    if not ready:
        return "no ready pod has a window yet"
    merged = Histogram.merge(s.ttft for s in ready.values())
    p99 = merged.quantile(0.99)
    basis = f"merged over {_count(len(ready), 'ready pod')}"
    if p99 is None:
        if any(s.num_running_seqs > 0 or s.num_requests_waiting > 0 for s in ready.values()):
            return "no request finished within the window while some were in flight"
        p99, basis = 0.0, f"{basis}, idle: no request within the window"
    ratio = p99 / target
    if abs(1 - ratio) <= tolerance:
        return Estimate(current, p99, ratio, basis)
    num_ready = sum(1 for state in pods.values() if state == "ready")
    return Estimate(ceil_replicas(ratio * num_ready), p99, ratio, basis)


def ceil_replicas(x: float) -> int:
    # The HPA computes in integer milli-units; rounding first keeps 0.935 / 0.85 * 10 at 11, not 12.
    return math.ceil(round(x, 9))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
