"""The autoscaler's step in a pilot pass, a function of its inputs that returns what to do.

In `mode: builtin` it decides the replicas (`autoscale.decide_replicas`: the HPA's algorithm on
the scraped windows); a change is written by the pilot through the InferenceService's scale
subresource (`spec.replicas`, which the reconcile copies to the Deployment), never to the
Deployment itself, so no two writers race. In every mode it says when the target is out of the
pods' reach while requests queue (`out_of_reach`): in the ScalingActive condition for as long as
it lasts (builtin, the decision's `TargetUnreachable`), and once in a Warning Event
`ScalingTargetUnreachable` each time it begins. Deletion costs (every mode) are the pilot's
patches of `deletion_cost.deletion_costs`.

With `spec.forecast` (builtin) it also looks ahead (`autoscale.forecast`): the pods' start-ups
are folded into the service's (`autoscale.startup`), this pass's arrival rate into a series whose
trend, one start-up plus one interval ahead, is one more input of the decision.

A scale-down waits while a tuning change is judged and for a dwell after it (`Coordination`, an
input and an output); a scale-up never waits. The state a step returns holds once its scale
write is made: when the write fails, the pilot keeps the state it had and the next pass decides
again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .autoscale.behavior import ScalerState
from .autoscale.calculator import PodState
from .autoscale.coordination import Coordination
from .autoscale.forecast import Forecast, RateSeries, look_ahead
from .autoscale.history import DecisionRecord, scale_record
from .autoscale.policy import decide_replicas, out_of_reach
from .autoscale.scaling_spec import ScalingSpec
from .autoscale.startup import PodStartup, Startup
from .autotune.window import WindowSummary
from .events import Event
from .objects import Manifest
from .status import condition
from .timestamps import epoch, iso

_INACTIVE = {"ScalingDisabled", "NoMetrics"}


@dataclass(frozen=True)
class ScalingState:
    """What the autoscaler keeps between passes; `status.scaling` holds what a restart needs."""

    behavior: ScalerState = ScalerState()  # the HPA algorithm's memory (stabilisation, rate limits)
    desired: int | None = None
    value: float | None = None  # the metric at the last decision
    last_scale: float | None = None
    condition: Manifest | None = None  # ScalingActive, mode builtin
    unreachable: str | None = None  # why the target is out of the pods' reach, while it is
    startup: Startup = Startup()  # the pods' creation to Ready
    rates: RateSeries = RateSeries()  # the arrival rate, a point a pass; a restarted operator starts anew
    forecast: Forecast | None = None  # at the last decision

    def to_status(self) -> Manifest:
        forecast = None if self.forecast is None else {
            "arrivalRate": round(self.forecast.rate_now, 4), "forecastRate": round(self.forecast.rate_ahead, 4),
            "horizonSeconds": round(self.forecast.horizon_s, 1)}
        out: dict[str, Any] = {"desiredReplicas": self.desired, "lastScaleTime": iso(self.last_scale)
                               if self.last_scale is not None else None,
                               "value": None if self.value is None else round(self.value, 6),
                               "startup": self.startup.to_status() or None, "forecast": forecast}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> ScalingState:
        return cls(desired=status.get("desiredReplicas"), value=status.get("value"),
                   last_scale=epoch(status.get("lastScaleTime")),
                   startup=Startup.from_status(status.get("startup") or {}))


@dataclass(frozen=True)
class ScalingInputs:
    now: float
    spec: ScalingSpec
    replicas: int  # spec.replicas as it stands
    summaries: Mapping[str, WindowSummary]  # each pod's window over (now - spec.window, now]
    pods: Mapping[str, PodState]  # every pod of the service: ready, starting or leaving
    coordination: Coordination
    dwell_s: float  # how long a tuning change holds scale-downs
    recent: Mapping[str, WindowSummary] = field(default_factory=dict)  # each pod's window since the last pass
    startups: tuple[PodStartup, ...] = ()  # the Ready pods' creation to Ready


@dataclass(frozen=True)
class ScalingStep:
    state: ScalingState
    coordination: Coordination
    scale_to: int | None = None  # the replicas to write through the scale subresource
    direction: Literal["up", "down"] | None = None  # of that write
    events: tuple[Event, ...] = ()
    records: tuple[DecisionRecord, ...] = ()


def watch_target(state: ScalingState, inputs: ScalingInputs) -> ScalingStep:
    """Every mode: `state.unreachable` kept current, and the Warning Event as it begins (an HPA
    on the same target would not scale either)."""
    unreachable = out_of_reach(inputs.summaries, inputs.pods, inputs.spec)
    events = (Event("Warning", "ScalingTargetUnreachable", unreachable),) \
        if unreachable is not None and state.unreachable is None else ()
    return ScalingStep(replace(state, unreachable=unreachable), inputs.coordination, events=events)


def scale(state: ScalingState, inputs: ScalingInputs) -> ScalingStep:
    """`mode: builtin`: the replicas the windows ask for, within what coordination allows."""
    spec, now = inputs.spec, inputs.now
    watched = watch_target(state, inputs)  # the decision says it too (TargetUnreachable)
    startup = state.startup.measured(inputs.startups)
    rates, forecast = look_ahead(state.rates, inputs.recent, inputs.pods, now, spec, startup.seconds)
    decision = decide_replicas(inputs.summaries, inputs.pods, inputs.replicas, spec, state.behavior, now=now,
                               forecast=forecast)
    value = decision.value if decision.value is not None else state.value
    state = replace(watched.state, value=value, startup=startup, rates=rates, forecast=forecast)
    direction = decision.direction
    if direction is not None:
        turn = inputs.coordination.may_scale(direction, now, inputs.dwell_s)
        if not turn.allowed:
            waiting = condition("ScalingActive", True, "WaitingForTuning", f"{decision.reason}; {turn.reason}")
            return replace(watched, state=replace(state, behavior=decision.state, condition=waiting))
    state = replace(state, desired=decision.desired)
    if direction is None:
        active = condition("ScalingActive", decision.code not in _INACTIVE, decision.code, decision.reason)
        return replace(watched, state=replace(state, behavior=decision.state, condition=active))
    scaled = replace(state, behavior=decision.scaled_state, last_scale=now,
                     condition=condition("ScalingActive", True, decision.code, decision.reason))
    return ScalingStep(scaled, inputs.coordination.scaled(now), decision.desired, direction,
                       watched.events + (Event("Normal", "Scaled", f"replicas {decision.current} -> "
                                                                   f"{decision.desired}: {decision.reason}"),),
                       (scale_record(decision),))
