"""A service's start-up: how long its pods take from creation to Ready, read from the pods' own
metadata and conditions, so the forecast looks as far ahead as a new replica needs (`forecast.py`).

A pod's start-up is its Ready condition's `lastTransitionTime` less its `creationTimestamp`:
scheduling, the image, the model load and the probes, everything between asking for a replica and
the Service sending it requests. Each pod counts once, when the operator first sees it Ready
after the newest start-up already folded in (`Startup.last_ready_time`, kept in status, so a
restarted operator counts no pod twice). A pod whose containers restarted is left out: its Ready
time is its restart's. The service's start-up is the median of its last `RECENT` pods' (one slow
node or a cold image cache does not move it far).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from statistics import median
from typing import Any

from ..timestamps import epoch, iso

RECENT = 10


@dataclass(frozen=True)
class PodStartup:
    pod: str
    ready_time: float  # seconds since the epoch
    seconds: float  # creation to Ready


def pod_startup(pod: Mapping[str, Any]) -> PodStartup | None:
    """The pod's start-up if it is Ready, never restarted, and both times are there."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ready = next((c for c in status.get("conditions") or []
                  if c.get("type") == "Ready" and c.get("status") == "True"), None)
    if ready is None or meta.get("deletionTimestamp"):
        return None
    if any(c.get("restartCount", 0) for c in status.get("containerStatuses") or []):
        return None
    created, became_ready = epoch(meta.get("creationTimestamp")), epoch(ready.get("lastTransitionTime"))
    if created is None or became_ready is None or became_ready < created:
        return None
    return PodStartup(meta.get("name", ""), became_ready, became_ready - created)


@dataclass(frozen=True)
class Startup:
    """The recent pods' start-ups, oldest first; a new value after each measurement."""

    recent: tuple[float, ...] = ()
    last_ready_time: float | None = None  # the newest Ready time folded in

    @property
    def seconds(self) -> float | None:
        return median(self.recent) if self.recent else None

    def measured(self, pods: Iterable[PodStartup]) -> Startup:
        """With the pods that became Ready after `last_ready_time` folded in, by Ready time."""
        new = sorted((p for p in pods if self.last_ready_time is None or p.ready_time > self.last_ready_time),
                     key=lambda p: p.ready_time)
        if not new:
            return self
        return replace(self, recent=(*self.recent, *(p.seconds for p in new))[-RECENT:],
                       last_ready_time=new[-1].ready_time)

    def to_status(self) -> dict[str, Any]:
        """`status.scaling.startup`; empty before any pod was measured."""
        if not self.recent or self.last_ready_time is None:
            return {}
        return {"seconds": round(median(self.recent), 1), "recent": [round(s, 1) for s in self.recent],
                "lastReadyTime": iso(self.last_ready_time)}

    @staticmethod
    def from_status(status: Mapping[str, Any]) -> Startup:
        recent = tuple(float(s) for s in status.get("recent") or [] if isinstance(s, int | float))
        return Startup(recent[-RECENT:], epoch(status.get("lastReadyTime")))

