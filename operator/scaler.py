"""The autoscaler's step in a pilot pass: deletion costs (every mode) and, in `mode: builtin`,
the replicas, written through the InferenceService's scale subresource (`spec.replicas`, which
the reconcile copies to the Deployment) — never the Deployment itself, so no two writers race.

A scale-down waits while a tuning change is judged and for a dwell after it (`Coordination`);
a scale-up never waits. A target the pods do not reach while requests queue (`out_of_reach`) is
said in the ScalingActive condition for as long as it lasts (the decision's `TargetUnreachable`),
and once in a Warning Event `ScalingTargetUnreachable` each time it begins, in every mode.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from . import metrics
from .autoscale.behavior import ScalerState
from .autoscale.deletion_cost import cost_patch, deletion_costs
from .autoscale.forecast import Forecast, RateSeries, look_ahead
from .autoscale.history import scale_record
from .autoscale.policy import decide_replicas, out_of_reach
from .autoscale.startup import Startup
from .kube import ApiError
from .status import condition
from .tuner import _iso

if TYPE_CHECKING:
    from .pilot import Pilot, Pods

logger = logging.getLogger(__name__)

Manifest = dict[str, Any]
_INACTIVE = {"ScalingDisabled", "NoMetrics"}


class Scaler:
    def __init__(self, pilot: Pilot, status: Manifest) -> None:
        self.pilot = pilot
        self.state = ScalerState()
        self.desired: int | None = status.get("desiredReplicas")
        self.value: float | None = status.get("value")
        self.last_scale: str | None = status.get("lastScaleTime")
        self.condition: Manifest | None = None
        self.unreachable: str | None = None  # why the target is out of the pods' reach, while it is
        self.startup = Startup.from_status(status.get("startup") or {})
        self.rates = RateSeries()  # one pass's arrival rate a point; a restarted operator starts anew
        self.forecast: Forecast | None = None

    def status(self) -> Manifest:
        out: Manifest = {}
        for key, value in (("desiredReplicas", self.desired), ("value", self.value),
                           ("lastScaleTime", self.last_scale)):
            if value is not None:
                out[key] = round(value, 6) if isinstance(value, float) else value
        if startup := self.startup.to_status():
            out["startup"] = startup
        if self.forecast is not None:
            out["forecast"] = {"arrivalRate": round(self.forecast.rate_now, 4),
                               "forecastRate": round(self.forecast.rate_ahead, 4),
                               "horizonSeconds": round(self.forecast.horizon_s, 1)}
        return out

    async def keep_deletion_costs(self, pods: Pods, now: float) -> None:
        """The least loaded pod is the one a scale-down removes."""
        pilot = self.pilot
        summaries = pilot.scraper.summaries(since=now - pilot.settings.scaling.window)
        for pod, cost in deletion_costs(summaries, pods.deletion_costs).items():
            try:
                await asyncio.to_thread(pilot.kube.patch, "Pod", pilot.key.namespace, pod, cost_patch(cost))
            except ApiError as exc:  # the pod went away meanwhile, most likely: the next pass tells
                logger.info(f"deletion cost of pod {pod} not written: {exc}")

    async def check_target(self, now: float, pods: Pods) -> str | None:
        """Why the target is out of the pods' reach, if it is (every mode: an HPA on the same
        target would not scale either); the Warning Event as it begins."""
        spec = self.pilot.settings.scaling
        unreachable = out_of_reach(self.pilot.scraper.summaries(since=now - spec.window), pods.states, spec)
        if unreachable is not None and self.unreachable is None:
            await self.pilot.post_event("Warning", "ScalingTargetUnreachable", unreachable)
        self.unreachable = unreachable
        return unreachable

    async def step(self, now: float, pods: Pods) -> None:
        pilot, spec = self.pilot, self.pilot.settings.scaling
        key = pilot.key
        current = int(pilot.body.get("spec", {}).get("replicas", 1))
        summaries = pilot.scraper.summaries(since=now - spec.window)
        self.startup = self.startup.measured(pods.startups)
        self.rates, self.forecast = look_ahead(self.rates, pilot.scraper.summaries(since=now - spec.interval),
                                               pods.states, now, spec, self.startup.seconds)
        decision = decide_replicas(summaries, pods.states, current, spec, self.state, now=now,
                                   forecast=self.forecast)
        self.value = decision.value if decision.value is not None else self.value
        await self.check_target(now, pods)  # the Event; the decision says it too (TargetUnreachable)
        metrics.DESIRED_REPLICAS.labels(key.namespace, key.name).set(decision.desired)
        active = decision.code not in _INACTIVE
        direction = decision.direction
        if direction is not None:
            turn = pilot.coordination.may_scale(direction, now, pilot.settings.dwell_s)
            if not turn.allowed:
                self.state = decision.state
                self.condition = condition("ScalingActive", True, "WaitingForTuning",
                                           f"{decision.reason}; {turn.reason}")
                return
        self.desired = decision.desired
        if direction is None:
            self.state = decision.state
            self.condition = condition("ScalingActive", active, decision.code, decision.reason)
            return
        await asyncio.to_thread(pilot.kube.patch, "InferenceService", key.namespace, key.name,
                                {"spec": {"replicas": decision.desired}}, "scale")
        self.state = decision.scaled_state
        pilot.coordination = pilot.coordination.scaled(now)
        self.last_scale = _iso(now)
        pilot.body.setdefault("spec", {})["replicas"] = decision.desired
        metrics.SCALING_DECISIONS.labels(key.namespace, key.name, direction).inc()
        pilot.record(scale_record(decision))
        self.condition = condition("ScalingActive", True, decision.code, decision.reason)
        await pilot.post_event("Normal", "Scaled", f"replicas {decision.current} -> {decision.desired}: "
                                                   f"{decision.reason}")
