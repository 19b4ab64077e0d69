"""What the autotuner keeps between two passes (`TunerState`), and how it goes into
`status.tuning` and comes back from it, so a restarted operator goes on where the last one
stopped: the tuned config, the canary being tried, the measured outcomes and switch pauses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.runtime.tunables import LiveConfig

from .autotune.outcomes import Outcomes
from .autotune.tuning_spec import Knobs
from .objects import Manifest
from .timestamps import epoch, iso

MAX_REASON_CHARS = 1024  # the CRD's bound on status.tuning.canary.reason


def short(config: LiveConfig) -> str:
    return str(Knobs.of(config))


@dataclass(frozen=True)
class Canary:
    """A change tried on one pod, judged before it goes to the others."""

    pod: str
    since: float
    target: LiveConfig
    previous: LiveConfig | None  # what a rollback restores; None: read back from a status without it
    reason: str
    reloaded: bool = False  # read back from status by a restarted operator: its windows before that are lost

    def to_status(self) -> Manifest:
        reason = self.reason if len(self.reason) <= MAX_REASON_CHARS else self.reason[:MAX_REASON_CHARS - 1] + "…"
        out = {"pod": self.pod, "since": iso(self.since), "target": self.target.to_status(), "reason": reason}
        return out if self.previous is None else {**out, "previous": self.previous.to_status()}

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> Canary | None:
        """The canary an earlier operator left in status.tuning.canary, or None."""
        status = status or {}
        since, target = epoch(status.get("since")), LiveConfig.from_status(status.get("target"))
        if not status.get("pod") or since is None or target is None:
            return None
        return cls(str(status["pod"]), since, target, LiveConfig.from_status(status.get("previous")),
                   str(status.get("reason") or ""), reloaded=True)


@dataclass(frozen=True)
class TunerState:
    # what tuning chose: the ConfigMap or the Deployment's flags carry it
    tuned: LiveConfig | None = None
    # the config in force: the pods' own (asked of one) until tuning first changes it
    config: LiveConfig | None = None
    last_change: float | None = None  # when the config in force last changed
    canary: Canary | None = None
    pods: Mapping[str, Knobs] = field(default_factory=dict)  # what each Ready pod last reported
    condition: Manifest | None = None  # Tuned
    attempted: float | None = None  # a refused admin call: the cooldown runs from it
    # what each configuration measured at capacity and each switch paused for; never changed in
    # place: a pass that adds to it returns a new copy
    outcomes: Outcomes = field(default_factory=Outcomes)
    observed: float | None = None  # the end of the span last fed to `outcomes`

    def to_status(self) -> Manifest:
        out: Manifest = {"pods": [{"pod": p, **k.to_status()} for p, k in sorted(self.pods.items())]}
        if self.tuned is not None:
            out["config"] = self.tuned.to_status()
        # None when there is none: the status patch then removes the last one
        out["canary"] = None if self.canary is None else self.canary.to_status()
        if self.last_change is not None:
            out["lastChangeTime"] = iso(self.last_change)
        return {**out, **self.outcomes.to_status()}

    @classmethod
    def from_status(cls, status: Mapping[str, Any], tuned: LiveConfig | None) -> TunerState:
        """`status`: status.tuning as an earlier operator left it; `tuned`: the tuned config it left
        (`reconcile.recorded_tuned`: the ConfigMap's or status's)."""
        return cls(tuned=tuned, config=tuned, last_change=epoch(status.get("lastChangeTime")),
                   canary=Canary.from_status(status.get("canary")), outcomes=Outcomes.from_status(status))
