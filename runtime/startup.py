"""Where a process's start-up time goes: named phases on one clock, reported as one record.

Each process of `kvpilot serve` (the API process and the engine core) keeps a `StartupLog`; the
core sends its phases with its `Ready` message and the API process logs the merged record as one
JSON line (prefix `startup: `) and answers it on `GET /ready`, so `kvpilot bench startup` reads
what the engine measured instead of guessing from the log's timestamps.

Times are wall-clock (`time.time()`), so phases of the two processes line up; `start_s` is a
phase's start after the API process started (the kernel's record of when the process began,
where /proc has it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any


def starting_phase(name: str, process: str) -> Phase:
    """The phase from the process's start until now (the interpreter, imports)."""
    started = process_start_time()
    return Phase(name, process, started, time.time() - started, time.process_time())


def process_start_time(pid: int | None = None) -> float:
    """When a process began (epoch seconds), from /proc on Linux (clock ticks after boot, set
    against the boot clock now: /proc/stat's boot time is whole seconds); now where unreadable."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            # the command name may hold spaces and parentheses: fields count from the last ')'
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


@dataclass
class Phase:
    name: str
    process: str  # "api" or "core"
    start: float  # epoch seconds
    seconds: float
    # CPU seconds the process used meanwhile (all its threads): what the phase cost, whatever else
    # ran on the machine; wall seconds on a busy machine mostly measure the others
    cpu_seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)  # what the phase moved or made (bytes, graphs...)


@dataclass
class StartupLog:
    process: str
    phases: list[Phase] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str, **details: Any) -> Iterator[dict[str, Any]]:
        """Time the block as phase `name`; the block may add details to the yielded dict."""
        start, cpu = time.time(), time.process_time()
        extra = dict(details)
        try:
            yield extra
        finally:
            self.phases.append(Phase(name, self.process, start, time.time() - start, time.process_time() - cpu, extra))

    def as_list(self) -> list[dict[str, Any]]:
        return [asdict(p) for p in self.phases]


def startup_record(process_start: float, ready: float, phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The merged record: every phase placed after the process start, in start order."""
    rows = []
    for p in sorted(phases, key=lambda p: p["start"]):
        row = {"name": p["name"], "process": p["process"], "start_s": round(p["start"] - process_start, 4),
               "seconds": round(p["seconds"], 4), "cpu_s": round(p.get("cpu_seconds", 0.0), 4)}
        row.update(p.get("details") or {})
        rows.append(row)
    return {"ready_s": round(ready - process_start, 4), "phases": rows}
