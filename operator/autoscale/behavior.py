"""HPA v2 `behavior`, applied as the HPA controller applies it
(`normalizeDesiredReplicasWithBehaviors` in kube-controller-manager), with the controller's
memory made explicit: a `ScalerState` goes in and a new one comes out, nothing is kept here.

1. *Stabilisation*: every estimate is recorded. The recommendation may rise no higher than the
   lowest estimate within the scaleUp window, and fall no lower than the highest estimate within
   the scaleDown window: a scale-down waits until the load has stayed low for the whole window
   (default 300 s), so traffic that flaps does not flap the replicas.
2. *Rate limits*: the replicas at the start of each policy's period are the current ones less
   the changes made within it; each policy allows that plus (or minus) `value` pods or `value`
   percent (rounded up when adding, down when removing); `selectPolicy` Max takes the policy that
   allows the largest change, Min the smallest, Disabled none.
3. *Bounds*: minReplicas and maxReplicas.
A state with no estimate yet (a new service, or the operator restarted) starts with the current
replicas as its one estimate, as the HPA controller does, so a restart never scales down at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TypeVar

from .scaling_spec import Behavior, ScalingRules


@dataclass(frozen=True)
class Recommendation:
    time: float
    replicas: int


@dataclass(frozen=True)
class ScaleEvent:
    time: float
    change: int  # pods added (scaleUp events) or removed (scaleDown events), > 0


_Timed = TypeVar("_Timed", Recommendation, ScaleEvent)


@dataclass(frozen=True)
class ScalerState:
    """What the HPA controller remembers about one target between two syncs."""

    recommendations: tuple[Recommendation, ...] = ()
    scale_ups: tuple[ScaleEvent, ...] = ()
    scale_downs: tuple[ScaleEvent, ...] = ()

    def scaled(self, now: float, before: int, after: int, behavior: Behavior) -> ScalerState:
        """The state once the replicas were written from `before` to `after`; only events within
        the longest period of their direction's policies are kept."""
        if after > before:
            kept = _recent(self.scale_ups, now, behavior.scale_up.longest_period_s)
            return replace(self, scale_ups=(*kept, ScaleEvent(now, after - before)))
        if after < before:
            kept = _recent(self.scale_downs, now, behavior.scale_down.longest_period_s)
            return replace(self, scale_downs=(*kept, ScaleEvent(now, before - after)))
        return self


@dataclass(frozen=True)
class Normalized:
    replicas: int
    code: str  # the HPA's reason: ScaleUpStabilized, ScaleUpLimit, TooManyReplicas, DesiredWithinRange...
    note: str  # "" when the estimate stands
    state: ScalerState  # with the estimate recorded


def normalize(estimate: int, current: int, min_replicas: int, max_replicas: int, behavior: Behavior,
              state: ScalerState, now: float) -> Normalized:
    if not state.recommendations:
        state = replace(state, recommendations=(Recommendation(now, current),))
    stabilized, code, note = _stabilize(estimate, current, behavior, state, now)
    longest = max(behavior.scale_up.stabilization_window_s, behavior.scale_down.stabilization_window_s)
    recommendations = (*_recent(state.recommendations, now, longest), Recommendation(now, estimate))
    state = replace(state, recommendations=recommendations)
    replicas, limit_code, limit_note = _limit(stabilized, current, min_replicas, max_replicas, behavior, state, now)
    if limit_code != "DesiredWithinRange" or not note:
        code = limit_code
    return Normalized(replicas, code, "; ".join(n for n in (note, limit_note) if n), state)


def _stabilize(estimate: int, current: int, behavior: Behavior, state: ScalerState,
               now: float) -> tuple[int, str, str]:
    up, down = behavior.scale_up, behavior.scale_down
    up_floor = min([estimate] + [r.replicas for r in state.recommendations
                                 if r.time > now - up.stabilization_window_s])
    down_ceiling = max([estimate] + [r.replicas for r in state.recommendations
                                     if r.time > now - down.stabilization_window_s])
    replicas = max(current, up_floor)
    replicas = min(replicas, down_ceiling)
    if replicas == estimate:
        return replicas, "DesiredWithinRange", ""
    if replicas < estimate:
        return replicas, "ScaleUpStabilized", (f"held at {replicas}, the lowest estimate within the scaleUp "
                                               f"stabilization window ({up.stabilization_window_s} s)")
    return replicas, "ScaleDownStabilized", (f"held at {replicas}, the highest estimate within the scaleDown "
                                             f"stabilization window ({down.stabilization_window_s} s)")


def _limit(desired: int, current: int, min_replicas: int, max_replicas: int, behavior: Behavior,
           state: ScalerState, now: float) -> tuple[int, str, str]:
    if desired > current:
        limit = max(current, _up_limit(current, behavior.scale_up, state, now))
        if limit < max_replicas and desired > limit:
            return limit, "ScaleUpLimit", f"limited to {limit} by the scaleUp policies"
        if desired > max_replicas:
            return max_replicas, "TooManyReplicas", f"limited to maxReplicas {max_replicas}"
    elif desired < current:
        limit = min(current, _down_limit(current, behavior.scale_down, state, now))
        if limit > min_replicas and desired < limit:
            return limit, "ScaleDownLimit", f"limited to {limit} by the scaleDown policies"
        if desired < min_replicas:
            return min_replicas, "TooFewReplicas", f"limited to minReplicas {min_replicas}"
    return desired, "DesiredWithinRange", ""


def _period_start(current: int, period_s: int, state: ScalerState, now: float) -> int:
    added = sum(e.change for e in state.scale_ups if e.time > now - period_s)
    removed = sum(e.change for e in state.scale_downs if e.time > now - period_s)
    return current - added + removed


def _up_limit(current: int, rules: ScalingRules, state: ScalerState, now: float) -> int:
    if rules.select_policy == "Disabled":
        return current
    proposals = []
    for p in rules.policies:
        start = _period_start(current, p.period_s, state, now)
        proposals.append(start + p.value if p.type == "Pods" else math.ceil(start * (1 + p.value / 100)))
    return max(proposals) if rules.select_policy == "Max" else min(proposals)


def _down_limit(current: int, rules: ScalingRules, state: ScalerState, now: float) -> int:
    if rules.select_policy == "Disabled":
        return current
    proposals = []
    for p in rules.policies:
        start = _period_start(current, p.period_s, state, now)
        proposals.append(start - p.value if p.type == "Pods" else math.floor(start * (1 - p.value / 100)))
    return min(proposals) if rules.select_policy == "Max" else max(proposals)


def _recent(items: tuple[_Timed, ...], now: float, span_s: float) -> tuple[_Timed, ...]:
    return tuple(i for i in items if i.time > now - span_s)
