"""The work queue, the workers that drain it, and the periodic resync, on kopf's event loop.

kopf's watch handlers only call `seen` (an InferenceService event) and `add` (an event of one of
its children); each worker takes a key, runs `Controller.sync` in a thread (the client is
synchronous) and decides, from its outcome, whether and when the key runs again.
"""

from __future__ import annotations

import asyncio
import logging

from .controller import Controller, Next
from .key import Key
from .workqueue import ShutDown, WorkQueue

logger = logging.getLogger(__name__)

CONFLICT_DELAY_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 60.0


class Runner:
    def __init__(self, controller: Controller, workers: int, resync_interval: float) -> None:
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, not {workers}")
        if resync_interval <= 0:
            raise ValueError(f"resync_interval: must be > 0, not {resync_interval}")
        self.controller, self.workers, self.resync_interval = controller, workers, resync_interval
        self.known: set[Key] = set()
        self._queue: WorkQueue[Key] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def queue(self) -> WorkQueue[Key]:
        if self._queue is None:
            raise RuntimeError("the runner is not started")
        return self._queue

    async def start(self) -> None:
        self._queue = WorkQueue(base_delay=1.0, max_delay=MAX_BACKOFF_SECONDS)
        self._tasks = [asyncio.create_task(self._work(), name=f"kvpilot worker {i}") for i in range(self.workers)]
        self._tasks.append(asyncio.create_task(self._resync(), name="kvpilot resync"))

    async def stop(self) -> None:
        self.queue.shut_down()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # waits for them to end without taking their CancelledError for one of the caller's own
            await asyncio.wait(self._tasks)

    def seen(self, key: Key, deleted: bool) -> None:
        """An event of the InferenceService itself (or the initial listing of it)."""
        if deleted:
            self.known.discard(key)
            self.queue.drop(key)
        else:
            self.known.add(key)
            self.queue.add(key)

    def add(self, key: Key) -> None:
        """An event of a child: its owner runs again, e.g. to repair a hand edit."""
        self.queue.add(key)

    async def _work(self) -> None:
        queue = self.queue
        while True:
            try:
                key = await queue.get()
            except ShutDown:
                return
            try:
                result = await asyncio.to_thread(self.controller.sync, key, queue.failures(key))
            except Exception:  # a bug must not end the worker: log it and back off like an API error
                logger.exception(f"reconciling InferenceService {key} failed")
                result = Next.BACK_OFF
            finally:
                queue.done(key)
            if result is Next.AGAIN_SOON:
                queue.add_after(key, CONFLICT_DELAY_SECONDS)
            elif result is Next.BACK_OFF:
                queue.retry(key)
            else:
                queue.forget(key)

    async def _resync(self) -> None:
        """Re-check every known InferenceService now and then: a safety net for a missed event."""
        while True:
            await asyncio.sleep(self.resync_interval)
            for key in sorted(self.known):
                self.queue.add(key)
