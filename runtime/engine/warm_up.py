"""Start-up work that serving does not need before the engine is ready, done afterwards.

An engine is ready to serve once its model, KV cache and the kernels and decode graphs of the block
size it starts with are there. What a later live block-size change will want — the other allowed
sizes' kernels and decode graphs (executor/model_runner.py's `prepare_later`) and one pass through
every size by the live switch path (block_switch.py's `warm_up_block_switches`) — is done after
it, one *unit* at a time between steps (a kernel probe or one decode graph: tens of milliseconds on
a GPU), so a request that arrives meanwhile waits for at most one unit. `kvpilot serve`'s engine
core runs units back to back while it has no request, and one every `BUSY_INTERVAL_S` while it
serves; the switch pass waits for an idle moment, as it re-lays blocks no sequence holds. A live
change that reaches a size before its graphs are done captures them itself. Work that would stall
a step for seconds (the swap space's pinned host memory) runs only while idle, before the units;
the step that needs it first does it itself. The offline `LLM` runs none of it: a switch there
prepares the size it switches to, the first swap-out allocates the swap space.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)


class WarmUp:
    BUSY_INTERVAL_S = 2.0  # while serving: at most one unit this often (each one stalls a step)

    def __init__(self, units: Iterator[str], idle_pass: Callable[[], None],
                 idle_first: list[tuple[str, Callable[[], None]]] | None = None) -> None:
        self._units: Iterator[str] | None = units
        self._idle_pass: Callable[[], None] | None = idle_pass
        # (name, work) run while idle before any unit: work too long to stall a step for (seconds),
        # which a step that needs it earlier does itself
        self._idle_first = list(idle_first or [])
        self._last = 0.0
        self._seconds = 0.0
        self._done: list[str] = []
        self._started: float | None = None

    @property
    def pending(self) -> bool:
        return self._units is not None or self._idle_pass is not None or bool(self._idle_first)

    def run_one(self, idle: bool) -> None:
        """Run the next unit; `idle`: the engine holds no sequence (the switch pass needs that)."""
        if not self.pending:
            return
        start = time.perf_counter()
        if self._started is None:
            self._started = time.time()
        if idle and self._idle_first:
            name, work = self._idle_first.pop(0)
            work()
            self._done.append(name)
        elif self._units is not None:
            unit = next(self._units, None)
            if unit is None:
                self._units = None
            else:
                self._done.append(unit)
        elif idle and self._idle_pass is not None:
            self._idle_pass()
            self._idle_pass = None
            self._done.append("block-size switch pass")
        end = time.perf_counter()
        self._last = end
        self._seconds += end - start
        if not self.pending:
            # one record, as the start-up's (runtime/startup.py): `kvpilot bench startup` reads it
            logger.info("after ready: %s", json.dumps({
                "units": len(self._done), "busy_seconds": round(self._seconds, 3),
                "wall_seconds": round(time.time() - self._started, 3)}))

    def run_if_due(self, idle: bool) -> None:
        """While serving: one unit if none ran in the last `BUSY_INTERVAL_S`."""
        if self.pending and time.perf_counter() - self._last >= self.BUSY_INTERVAL_S:
            self.run_one(idle)

    def finish(self) -> None:
        """Everything left, now (the engine must hold no sequence)."""
        while self.pending:
            self.run_one(idle=True)
