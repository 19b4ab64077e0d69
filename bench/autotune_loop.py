"""The autotuner as the operator runs it, on live servers: every `spec.interval_s` the operator's
`ServiceScraper` scrapes each server's `/metrics` and the operator's own tuning step
(`kvpilot.operator.tuner.tune`: the policy, the canary and its judgement, the measured outcomes,
the switch costs) decides and calls `POST /admin/config` through the operator's `AdminClient`.
Only the pods (the benchmark's servers) and the clock are the benchmark's; nothing here decides
anything: a change in the operator's step is a change in what this loop does.

One server is one replica: a change is tried on it as a canary, judged against its own window
before the change, and promoted or rolled back, as the operator does for a one-replica service.
Each admin call that changed something is recorded with the engine's own account of its pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

import aiohttp

from kvpilot.operator.autoscale.coordination import Coordination
from kvpilot.operator.autotune import (
    AdminClient,
    EngineLimits,
    PodEndpoint,
    ServiceScraper,
    TuningSpec,
)
from kvpilot.operator.tuner import TuningInputs, tune
from kvpilot.operator.tuner_state import TunerState


@dataclass
class TunerLog:
    switches: list[dict[str, Any]] = field(default_factory=list)  # admin calls that changed a config
    num_decisions: int = 0
    num_holds: int = 0
    scrape_failures: int = 0
    admin_errors: list[str] = field(default_factory=list)
    # every pass: time, action, the config in force, the Tuned condition's reason and message
    decisions: list[dict[str, Any]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)  # the operator's decision records
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pause_s(self) -> float:
        return sum(s["pause_s"] for s in self.switches)


class LiveTuner:
    def __init__(self, endpoints: list[PodEndpoint], spec: TuningSpec, limits: EngineLimits, admin_token: str,
                 started_at: float) -> None:
        self.endpoints = endpoints
        self.spec = spec
        self.limits = limits
        self.admin_token = admin_token
        self.started_at = started_at  # wall clock of the load's start: everything is timed from it
        self.log = TunerLog()
        self.state = TunerState()

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape, take the operator's tuning step, until `stop` is set."""
        spec = self.spec
        async with aiohttp.ClientSession() as session:
            scraper = ServiceScraper("bench", "autotune", session, timeout_s=min(10.0, spec.interval_s),
                                     span_s=spec.window_span_s)
            admin = AdminClient(session, self.admin_token, timeout_s=60, attempts=3, backoff_s=0.2)
            while not stop.is_set():
                report = await scraper.scrape(self.endpoints)
                self.log.scrape_failures += len(report.failures)
                now = time.time()
                inputs = TuningInputs(now, spec, self.limits, {}, scraper.windows,
                                      {p: s.settings for p, s in report.samples.items()},
                                      {e.pod: e for e in self.endpoints if e.pod in report.samples},
                                      Coordination(), dwell_s=0.0, num_failures=len(report.failures))
                step = await tune(self.state, inputs, admin)
                self.state = step.state
                self._record(now, step, inputs.summaries(since=now - 2 * spec.interval_s))
                with contextlib.suppress(TimeoutError):  # asyncio.timeout keeps a cancellation
                    async with asyncio.timeout(spec.interval_s):
                        await stop.wait()

    def _record(self, now: float, step: Any, recent: dict[str, Any]) -> None:
        at = now - self.started_at
        # what the pods showed over the last intervals (means over pods), beside the step's verdict
        signals = None if not recent else {
            "queue_depth": fmean(s.num_waiting_seqs for s in recent.values()),
            "preemptions_per_s": fmean(s.preemptions_per_s for s in recent.values())}
        condition = step.state.condition or {}
        config = step.state.config
        self.log.num_decisions += 1
        self.log.num_holds += step.action == "wait"
        self.log.decisions.append({"at_s": at, "action": step.action, "outcome": step.outcome,
                                   "config": dataclasses.asdict(config) if config is not None else None,
                                   "reason": condition.get("reason"), "message": condition.get("message"),
                                   "signals": signals})
        for call in step.calls:
            if call.config is None:
                self.log.admin_errors.append(call.error)
            elif call.before is not None and call.before != call.config:
                self.log.switches.append({"at_s": at, "pod": call.pod, "action": step.action,
                                          "from": dataclasses.asdict(call.before),
                                          "to": dataclasses.asdict(call.config),
                                          "reason": condition.get("message"), "pause_s": call.duration_s,
                                          "relayout_pause_s": call.pause_s})
        self.log.records += [{**r.to_status(), "at_s": r.time - self.started_at} for r in step.records]
        self.log.events += [{"at_s": at, **dataclasses.asdict(e)} for e in step.events]
