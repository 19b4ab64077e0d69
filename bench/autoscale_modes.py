"""How `mode: hpa` and `mode: keda` decide, as the operator deploys them, for the fleet simulator.

Both read the engines' series from Prometheus, which scrapes each Ready pod every
`Cluster.prometheus_interval_s` (the chart's `engineMonitoring.interval`), and both are run by the
HPA controller, which syncs every `Cluster.hpa_sync_s` (kube-controller-manager's default) and
applies `spec.autoscaling.behavior` and the tolerance as the builtin policy does
(`operator/autoscale/behavior.py`). They differ in the query and in the HPA's rule for it:

* hpa — a `Pods` metric with an AverageValue target, served by prometheus-adapter's rule
  `sum(avg_over_time(series[window]))` by pod, over the chart's `prometheusAdapterRules.window`
  (`Cluster.adapter_window_s`). The HPA's replica calculator takes each pod's value
  (`operator/autoscale/calculator.py`, its `calcPlainMetricReplicas`), with the pods as the HPA
  groups them: a Pending pod is *unready* (left out; assumed at 0 on a scale-up), a Running pod
  without metrics (loading its model, or Ready but not scraped yet) *missing* (at 0 on a scale-up,
  at the target on a scale-down), a pod being deleted ignored.
* keda — an `External` metric with an AverageValue target: the ScaledObject's query
  `sum(avg_over_time(series[window]))` over every series in the range, those of pods already gone
  included, over `spec.autoscaling.window`; the HPA asks for ceil(sum / target) replicas unless
  sum / (target x replicas) is within the tolerance of 1 (its `GetExternalPerPodMetricReplicas`),
  whatever state the pods are in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvpilot.operator.autoscale import PodState, ScalerState, ScalingSpec
from kvpilot.operator.autoscale.behavior import normalize
from kvpilot.operator.autoscale.calculator import PER_POD, ceil_replicas, estimate
from kvpilot.operator.autotune import WindowSummary

Phase = Literal["pending", "loading", "ready", "leaving"]
_HPA_STATE: dict[Phase, PodState] = {"pending": "starting", "loading": "ready", "ready": "ready",
                                     "leaving": "leaving"}


@dataclass(frozen=True)
class Cluster:
    """The cluster around modes hpa and keda, as the chart and Kubernetes set it by default."""

    prometheus_interval_s: float = 15.0  # the chart's engineMonitoring.interval
    prometheus_phase_s: float = 7.0  # when Prometheus scrapes within an HPA sync period
    adapter_window_s: float = 60.0  # the chart's prometheusAdapterRules.window
    hpa_sync_s: float = 15.0  # kube-controller-manager --horizontal-pod-autoscaler-sync-period

    def __post_init__(self) -> None:
        for name in ("prometheus_interval_s", "adapter_window_s", "hpa_sync_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, not {getattr(self, name)}")
        if self.prometheus_phase_s < 0:
            raise ValueError(f"prometheus_phase_s: must be >= 0, not {self.prometheus_phase_s}")


Decided = tuple[int, ScalerState, ScalerState]  # desired, the state to keep, the state once written


def hpa_decision(per_pod: Mapping[str, WindowSummary], phases: Mapping[str, Phase], current: int,
                 spec: ScalingSpec, state: ScalerState, now: float) -> Decided:
    """`per_pod`: each Ready pod's series over the adapter's range, for those Prometheus has."""
    states = {pod: _HPA_STATE[phase] for pod, phase in phases.items()}
    est = estimate(spec.metric, per_pod, states, current, spec.target, spec.tolerance)
    return _normalized(current if isinstance(est, str) else est.replicas, current, spec, state, now)


def keda_decision(series: Sequence[WindowSummary], current: int, spec: ScalingSpec, state: ScalerState,
                  now: float) -> Decided:
    """`series`: every pod's over the ScaledObject's range, gone pods' included; none reads as 0
    (the Prometheus scaler's `ignoreNullValues`)."""
    total = sum(PER_POD[spec.metric](s) for s in series)
    ratio = total / (spec.target * current)
    wanted = current if abs(1 - ratio) <= spec.tolerance else ceil_replicas(total / spec.target)
    return _normalized(wanted, current, spec, state, now)


def _normalized(wanted: int, current: int, spec: ScalingSpec, state: ScalerState, now: float) -> Decided:
    n = normalize(wanted, current, spec.min_replicas, spec.max_replicas, spec.behavior, state, now)
    return n.replicas, n.state, n.state.scaled(now, current, n.replicas, spec.behavior)
