"""One decision at a time per service: the autotuner and the autoscaler take turns.

Each judges the service from windows of per-pod metrics, and each change spoils the other's
windows: a scale event moves every pod's load, so a tuning decision on a window that spans it
would credit (or blame) the config for the change in load; a tuning change moves a pod's
capacity, so a scale-down on a window from before it would size the fleet for an engine that is
no longer running. Hence:
* after a scale event, tuning waits `dwell_s`;
* while a tuning change is being judged (a canary, a rollout), and for `dwell_s` after it takes
  effect, the replicas do not go down;
* scaling up never waits: a queue hurts every request now, a tuning change only some later.
Within one pass the scaling decision goes first; once it scaled, tuning waits, so one pass never
changes both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class Turn:
    allowed: bool
    reason: str  # why not; "" when allowed


@dataclass(frozen=True)
class Coordination:
    """What one service's last decisions were; a new value after each, never edited in place."""

    last_scale: float | None = None
    last_tune: float | None = None  # when the last tuning change took effect on every pod
    tuning_in_flight: bool = False  # a canary being judged, or a rollout of tuned flags

    def may_scale(self, direction: Literal["up", "down"], now: float, dwell_s: float) -> Turn:
        if direction == "up":
            return Turn(True, "")
        if self.tuning_in_flight:
            return Turn(False, "a tuning change is being judged: scale-down waits for its verdict")
        if self.last_tune is not None and now - self.last_tune < dwell_s:
            return Turn(False, f"tuned {now - self.last_tune:.0f} s ago: scale-down waits {dwell_s:g} s for "
                               f"windows that show the new config")
        return Turn(True, "")

    def may_tune(self, now: float, dwell_s: float) -> Turn:
        if self.last_scale is not None and now - self.last_scale < dwell_s:
            return Turn(False, f"scaled {now - self.last_scale:.0f} s ago: tuning waits {dwell_s:g} s for "
                               f"windows at the new load")
        return Turn(True, "")

    def scaled(self, now: float) -> Coordination:
        return replace(self, last_scale=now)

    def tuning_started(self) -> Coordination:
        """A change went to a canary pod or a rollout began."""
        return replace(self, tuning_in_flight=True)

    def tuning_settled(self, now: float) -> Coordination:
        """A change reached every pod (applied live, promoted, or rolled out) or was rolled back."""
        return replace(self, tuning_in_flight=False, last_tune=now)
