"""The autotuner's step in a pilot pass: converge, judge a canary, or decide.

* *Config in force*: the service's tuned `LiveConfig`; at first what the pods report
  (`GET /admin/config`), or what status held when the operator restarted.
* *Converge*: a Ready pod that reports another block size or preemption mode than the config in
  force (restarted before its ConfigMap was current, or added by a scale-up) is brought to it
  with `POST /admin/config`, without touching the others.
* *Canary*: a change the policy (`autotune.decide`) asks for goes to one pod; `autotune.judge`
  compares it with the other pods (alone: with its own window before the change) until it
  promotes the change to every pod (one at a time) or rolls the canary back.
* *Memory*: what each configuration measured at capacity and what each switch paused the engine
  for (`autotune.Outcomes`) go into status.tuning with the config, and a restarted operator
  reloads them, so it neither measures again nor retries what it already found worse. A spec
  whose model, image, GPUs, placement or engine flags changed drops them (Event
  TuningOutcomesReset): they held for the old one. Nothing is measured while pods of two pod
  templates run (a rollout of another spec under way).
With `apply: rollout` there is no canary: the decision becomes the config in force, and the
reconcile writes it into the Deployment's flags, which rolls the pods.

A pod that refuses the admin call leaves the service on its previous config: the canary is not
started (or is rolled back), Tuned turns False with reason AdminCallFailed, and the cooldown
applies before the next try.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import metrics
from .autoscale.history import DecisionRecord, tune_record
from .autotune.admin import AdminClient, AdminError
from .autotune.canary import judge
from .autotune.endpoint import PodEndpoint
from .autotune.live_config import LiveConfig
from .autotune.outcomes import Outcomes
from .autotune.policy import decide
from .autotune.scrape import ScrapeReport
from .autotune.tuning_spec import EngineTarget
from .objects import Manifest
from .status import condition
from .timestamps import epoch, iso

if TYPE_CHECKING:
    from .pilot import Pilot, Pods

logger = logging.getLogger(__name__)



def _knobs(c: LiveConfig) -> EngineTarget:
    return EngineTarget(c.block_size, c.preemption_mode)


def _short(c: LiveConfig) -> str:
    return f"block_size {c.block_size}, {c.preemption_mode}"


@dataclass(frozen=True)
class Canary:
    pod: str
    since: float
    target: LiveConfig
    previous: LiveConfig | None  # None: read back from a status that did not keep it (then the config in force)
    reason: str
    reloaded: bool = False  # read back from status by a restarted operator: its windows before that are lost

    def to_status(self) -> Manifest:
        out = {"pod": self.pod, "since": iso(self.since), "target": self.target.to_status(),
               "reason": _cut(self.reason)}
        return out if self.previous is None else {**out, "previous": self.previous.to_status()}

    @classmethod
    def from_status(cls, status: Manifest | None) -> Canary | None:
        """The canary an earlier operator left in status.tuning.canary, or None."""
        status = status or {}
        since, target = epoch(status.get("since")), LiveConfig.from_status(status.get("target"))
        if not status.get("pod") or since is None or target is None:
            return None
        return cls(str(status["pod"]), since, target, LiveConfig.from_status(status.get("previous")),
                   str(status.get("reason") or ""), reloaded=True)


def _cut(text: str, limit: int = 1024) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


class Tuner:
    def __init__(self, pilot: Pilot, status: Manifest, tuned: LiveConfig | None) -> None:
        """`status`: status.tuning as an earlier operator left it; `tuned`: the tuned config it
        left (the ConfigMap's or status's: `reconcile.recorded_tuned`)."""
        self.pilot = pilot
        # `tuned`: the config tuning chose (what the ConfigMap or the flags carry); `config`: the
        # one in force, the pods' own until tuning first changes it.
        self.tuned: LiveConfig | None = tuned
        self.config: LiveConfig | None = self.tuned
        self.last_change = epoch(status.get("lastChangeTime"))
        # a canary in progress when the operator stopped is judged on (or rolled back) by this one
        self.canary: Canary | None = Canary.from_status(status.get("canary"))
        if self.canary is not None:
            pilot.coordination = pilot.coordination.tuning_started()
        self.pods: dict[str, tuple[int, str]] = {}
        self.condition: Manifest | None = None
        self.attempted: float | None = None  # a failed admin call: the cooldown runs from it
        self.outcomes = Outcomes.from_status(status)  # what an earlier operator measured
        self.observed: float | None = None  # the end of the span last fed to `outcomes`

    def status(self) -> Manifest:
        out: Manifest = {"pods": [{"pod": p, "blockSize": b, "preemptionMode": m}
                                  for p, (b, m) in sorted(self.pods.items())]}
        if self.tuned is not None:
            out["config"] = self.tuned.to_status()
        # None when there is none: the status patch then removes the last one
        out["canary"] = None if self.canary is None else self.canary.to_status()
        if self.last_change is not None:
            out["lastChangeTime"] = iso(self.last_change)
        return {**out, **self.outcomes.to_status()}

    def _set(self, status: bool | None, reason: str, message: str) -> None:
        self.condition = condition("Tuned", status, reason, message)

    async def step(self, now: float, pods: Pods, report: ScrapeReport) -> None:
        spec = self.pilot.settings.tuning
        changed = self.outcomes.rebase(dict(self.pilot.settings.basis))
        if changed:
            self.observed = None  # windows scraped so far ran under the old basis
            await self.pilot.post_event("Normal", "TuningOutcomesReset",
                                        "measured outcomes and switch pauses dropped, they were measured under "
                                        f"another spec: {'; '.join(changed)}")
        endpoints = {e.pod: e for e in pods.endpoints if e.pod in report.samples}
        self.pods = {p: (s.settings.block_size, s.settings.preemption_mode) for p, s in report.samples.items()}
        # while a rollout runs pods of two specs, their windows are no configuration's capacity
        if self.observed is not None and len(pods.templates) <= 1:
            self.outcomes.observe(self.pilot.scraper.summaries(since=self.observed), spec.thresholds,
                                  last_change=self.last_change)
        self.observed = now
        if not endpoints:
            self._set(None, "AwaitingMetrics", f"no Ready pod could be scraped ({len(report.failures)} failed)")
            return
        admin = AdminClient(self.pilot.session, await self.pilot.admin_token(), timeout_s=10, attempts=3,
                            backoff_s=0.2)
        if self.config is None:
            # the pods' own config; a reloaded canary's pod runs the target, so another is asked
            others = [p for p in endpoints if self.canary is None or p != self.canary.pod]
            try:
                self.config = await admin.get_config(endpoints[min(others or endpoints)])
            except AdminError as exc:
                self._set(False, "AdminCallFailed", str(exc))
                return
        if self.canary is not None and self.canary.previous is None:
            self.canary = dataclasses.replace(self.canary, previous=self.config)
        if spec.apply == "rollout":
            await self._decide(now, endpoints, admin)
            return
        if self.canary is not None:
            await self._judge(now, endpoints, admin)
            return
        if not await self._converge(endpoints, admin):
            return
        await self._decide(now, endpoints, admin)

    async def _converge(self, endpoints: dict[str, PodEndpoint], admin: AdminClient) -> bool:
        """Bring every pod to the config in force; False when one refused (the condition says so)."""
        assert self.config is not None
        for pod, settings in sorted(self.pods.items()):
            if pod in endpoints and settings != (self.config.block_size, self.config.preemption_mode):
                try:
                    await self._apply(admin, endpoints[pod], self.config)
                except AdminError as exc:
                    self._set(False, "AdminCallFailed", f"could not bring pod {pod} to the config in force: {exc}")
                    await self.pilot.post_event("Warning", "AdminCallFailed", str(exc))
                    return False
                self.pods[pod] = (self.config.block_size, self.config.preemption_mode)
                await self.pilot.post_event("Normal", "TuningConverged",
                                            f"pod {pod} brought to the service's {_short(self.config)}")
        return True

    async def _apply(self, admin: AdminClient, endpoint: PodEndpoint, target: LiveConfig) -> LiveConfig:
        current = await admin.get_config(endpoint)
        changes = current.changes_to(target)
        if not changes:
            return current
        applied = await admin.apply(endpoint, changes)
        if applied.relayout_pause_s is not None:
            self.outcomes.record_pause(_knobs(current), _knobs(applied.config), applied.relayout_pause_s)
        return applied.config

    async def _decide(self, now: float, endpoints: dict[str, PodEndpoint], admin: AdminClient) -> None:
        pilot, spec = self.pilot, self.pilot.settings.tuning
        assert self.config is not None
        turn = pilot.coordination.may_tune(now, pilot.settings.dwell_s)
        if not turn.allowed:
            self._set(True if self.condition is None else self.condition["status"] == "True",
                      "WaitingForScaling", turn.reason)
            return
        last = max((t for t in (self.last_change, self.attempted) if t is not None), default=None)
        summaries = pilot.scraper.summaries(since=now - spec.min_dwell_s)
        decision = decide(summaries, self.config, spec, pilot.settings.limits, now=now, last_change=last,
                          measured=self.outcomes.measured(spec.canary.window_s), pauses=self.outcomes.pauses())
        if decision.target is None:
            metrics.TUNING_DECISIONS.labels(*self._labels, "skipped").inc()
            waiting = decision.signals is None
            if self.condition is None or self.condition["reason"] in ("AwaitingMetrics", "ConfigHolds") \
                    or not waiting:
                self._set(None if waiting and self.last_change is None else True,
                          "AwaitingMetrics" if waiting and self.last_change is None else "ConfigHolds",
                          decision.reason)
            return
        record = tune_record(decision, now)
        if spec.apply == "rollout":
            self.config = self.tuned = decision.target
            self.last_change = now
            metrics.TUNING_DECISIONS.labels(*self._labels, "applied").inc()
            pilot.record(record)
            pilot.coordination = pilot.coordination.tuning_settled(now)
            self._set(True, "RollingOut", f"{_short(decision.target)} goes into the Deployment's flags: "
                                          f"{decision.reason}")
            await pilot.post_event("Normal", "Tuned", f"rolling out {_short(decision.target)}: {decision.reason}")
            return
        pod = min(endpoints, key=lambda p: (self._load(p), p))
        try:
            await self._apply(admin, endpoints[pod], decision.target)
        except AdminError as exc:
            self.attempted = now
            message = f"the canary change to {_short(decision.target)} was refused; the service stays on " \
                      f"{_short(self.config)}: {exc}"
            self._set(False, "AdminCallFailed", message)
            await pilot.post_event("Warning", "AdminCallFailed", message)
            return
        self.canary = Canary(pod, now, decision.target, self.config, decision.reason)
        pilot.coordination = pilot.coordination.tuning_started()
        metrics.TUNING_DECISIONS.labels(*self._labels, "canary").inc()
        pilot.record(dataclasses.replace(record, reason=f"canary on pod {pod}: {decision.reason}"))
        self._set(None, "CanaryInProgress", f"pod {pod} tries {_short(decision.target)}: {decision.reason}")
        await pilot.post_event("Normal", "TuningCanary", f"pod {pod} tries {_short(decision.target)} "
                                                         f"(from {_short(self.config)}): {decision.reason}")

    def _load(self, pod: str) -> float:
        window = self.pilot.scraper.windows.get(pod)
        sample = window.latest if window is not None else None
        return 0.0 if sample is None else sample.gauges["num_running_seqs"] + sample.gauges["num_waiting_seqs"]

    async def _judge(self, now: float, endpoints: dict[str, PodEndpoint], admin: AdminClient) -> None:
        pilot, spec, canary = self.pilot, self.pilot.settings.tuning, self.canary
        assert canary is not None and canary.previous is not None
        if canary.pod not in endpoints:
            message = f"canary pod {canary.pod} went away; the service stays on {_short(canary.previous)}"
            self._settle(now, DecisionRecord(now, "tune", _short(canary.target), _short(canary.previous), message))
            self._set(True, "CanaryLost", message)
            await pilot.post_event("Warning", "TuningCanaryLost", message)
            return
        since = pilot.scraper.summaries(since=canary.since)
        baseline = [s for p, s in since.items() if p != canary.pod]
        if not baseline and canary.reloaded and not (set(endpoints) - {canary.pod}):
            # alone, a canary is judged against its own window before the change, which went
            # with the operator that started it: nothing fair is left to judge it on
            await self._roll_back(now, endpoints, admin, "the operator restarted during the canary and the "
                                                         "window before the change, which a lone canary is "
                                                         "judged against, was lost")
            return
        if not baseline and (window := pilot.scraper.windows.get(canary.pod)) is not None:
            before = window.summarize(since=canary.since - spec.canary.window_s, until=canary.since)
            baseline = [before] if before is not None else []
        verdict = judge(since.get(canary.pod), baseline, canary.target, spec, elapsed_s=now - canary.since)
        if verdict.verdict == "wait":
            self._set(None, "CanaryInProgress", f"pod {canary.pod} tries {_short(canary.target)}: {verdict.reason}")
        elif verdict.verdict == "promote":
            await self._promote(now, endpoints, admin, verdict.reason)
        else:
            await self._roll_back(now, endpoints, admin, verdict.reason)

    def _settle(self, now: float, record: DecisionRecord) -> None:
        """The canary ends: the change and its verdict go into the history."""
        self.canary, self.last_change = None, now
        self.pilot.coordination = self.pilot.coordination.tuning_settled(now)
        self.pilot.record(record)

    async def _promote(self, now: float, endpoints: dict[str, PodEndpoint], admin: AdminClient, why: str) -> None:
        pilot, canary = self.pilot, self.canary
        assert canary is not None and canary.previous is not None
        self._settle(now, DecisionRecord(now, "tune", _short(canary.previous), _short(canary.target),
                                         f"promoted from pod {canary.pod}: {why}"))
        failed = []
        for pod in sorted(p for p in endpoints if p != canary.pod):
            try:
                await self._apply(admin, endpoints[pod], canary.target)
                self.pods[pod] = (canary.target.block_size, canary.target.preemption_mode)
            except AdminError as exc:
                failed.append(str(exc))
        self.config = self.tuned = canary.target
        self.pods[canary.pod] = (canary.target.block_size, canary.target.preemption_mode)
        metrics.TUNING_DECISIONS.labels(*self._labels, "promoted").inc()
        message = f"{_short(canary.target)} promoted from pod {canary.pod} to every pod: {why}"
        if failed:  # the next passes converge them
            self._set(False, "AdminCallFailed", f"{message}; not yet on: {'; '.join(failed)}")
        else:
            self._set(True, "Promoted", message)
        await pilot.post_event("Normal", "TuningPromoted", message)

    async def _roll_back(self, now: float, endpoints: dict[str, PodEndpoint], admin: AdminClient, why: str) -> None:
        pilot, canary = self.pilot, self.canary
        assert canary is not None and canary.previous is not None
        self._settle(now, DecisionRecord(now, "tune", _short(canary.target), _short(canary.previous),
                                         f"rolled back on pod {canary.pod}: {why}"))
        try:
            await self._apply(admin, endpoints[canary.pod], canary.previous)
            self.pods[canary.pod] = (canary.previous.block_size, canary.previous.preemption_mode)
        except AdminError as exc:  # the next pass converges it
            logger.warning(f"rolling back canary pod {canary.pod}: {exc}")
        metrics.TUNING_DECISIONS.labels(*self._labels, "rolled_back").inc()
        metrics.TUNING_ROLLBACKS.labels(*self._labels).inc()
        message = f"pod {canary.pod} back to {_short(canary.previous)}: {why}"
        self._set(True, "RolledBack", message)
        await pilot.post_event("Warning", "TuningRolledBack", message)

    @property
    def _labels(self) -> tuple[str, str]:
        return self.pilot.key.namespace, self.pilot.key.name
