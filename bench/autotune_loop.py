"""The autotuner as the operator runs it, on one live server: every `spec.interval_s` the operator's
`ServiceScraper` scrapes `/metrics`, the operator's `decide` turns the window into a decision, and
`AdminClient` applies it through `POST /admin/config`. Nothing here decides anything itself: a
change in the operator's policy is a change in what this loop does.

One server is one replica, so there is no other pod to canary against; every decision goes
straight to the server (the operator's canary step is judged separately, in its own tests).
Each applied change is recorded with the engine's own account of the pause it caused, which the
policy weighs against the next such switch's expected gain (as the operator does).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvpilot.operator.autotune import (
    AdminClient,
    AdminError,
    EngineLimits,
    EngineTarget,
    LiveConfig,
    Outcomes,
    PodEndpoint,
    ServiceScraper,
    TuningSpec,
    decide,
)


@dataclass
class TunerLog:
    switches: list[dict[str, Any]] = field(default_factory=list)  # applied changes
    num_decisions: int = 0
    num_holds: int = 0
    scrape_failures: int = 0
    admin_errors: list[str] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)  # every decision: time, config, signals, reason

    @property
    def pause_s(self) -> float:
        return sum(s["pause_s"] for s in self.switches)


class LiveTuner:
    def __init__(self, endpoint: PodEndpoint, spec: TuningSpec, limits: EngineLimits, admin_token: str,
                 started_at: float) -> None:
        self.endpoint = endpoint
        self.spec = spec
        self.limits = limits
        self.admin_token = admin_token
        self.started_at = started_at  # wall clock of the load's start: switches are timed from it
        self.log = TunerLog()
        self.outcomes = Outcomes()

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape, decide, apply, until `stop` is set."""
        spec = self.spec
        async with aiohttp.ClientSession() as session:
            scraper = ServiceScraper("bench", "autotune", session, timeout_s=min(10.0, spec.interval_s),
                                     span_s=spec.window_span_s)
            admin = AdminClient(session, self.admin_token)
            current = await admin.get_config(self.endpoint)
            last_change: float | None = None
            observed: float | None = None  # the end of the span last fed to the outcomes
            while not stop.is_set():
                report = await scraper.scrape([self.endpoint])
                self.log.scrape_failures += len(report.failures)
                now = time.time()
                if observed is not None:
                    self.outcomes.observe(scraper.summaries(since=observed), spec.thresholds, last_change=last_change)
                observed = now
                measured = self.outcomes.measured(spec.canary.window_s)
                decision = decide(scraper.summaries(since=now - spec.min_dwell_s), current, spec, self.limits,
                                  now=now, last_change=last_change, measured=measured,
                                  pauses=self.outcomes.pauses())
                self.log.num_decisions += 1
                self.log.decisions.append({
                    "at_s": now - self.started_at, "config": _knobs(current), "reason": decision.reason,
                    "signals": dataclasses.asdict(decision.signals) if decision.signals else None,
                    "measured": {f"{c.block_size}/{c.preemption_mode}": dataclasses.asdict(e)
                                 for c, e in measured.items()}})
                if decision.changes:
                    try:
                        applied = await admin.apply(self.endpoint, decision.changes)
                    except AdminError as e:
                        self.log.admin_errors.append(str(e))
                    else:
                        self.log.switches.append({
                            "at_s": now - self.started_at, "from": _knobs(current), "to": _knobs(applied.config),
                            "reason": decision.reason, "pause_s": applied.duration_s,
                            "relayout_pause_s": applied.relayout_pause_s,
                            "signals": dataclasses.asdict(decision.signals) if decision.signals else None,
                        })
                        if applied.relayout_pause_s is not None:
                            self.outcomes.record_pause(EngineTarget(current.block_size, current.preemption_mode),
                                                       EngineTarget(applied.config.block_size,
                                                                    applied.config.preemption_mode),
                                                       applied.relayout_pause_s)
                        current = applied.config
                        last_change = time.time()
                else:
                    self.log.num_holds += 1
                with contextlib.suppress(TimeoutError):  # asyncio.timeout keeps a cancellation
                    async with asyncio.timeout(spec.interval_s):
                        await stop.wait()


def _knobs(config: LiveConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
