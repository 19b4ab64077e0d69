"""A work queue of keys to reconcile, as controller-runtime's (client-go's workqueue) has it.

Events only *add* a key; workers *get* keys and reconcile them. Three promises make one worker
per object the only writer of its status, with no conflict storm:

* a key waits in the queue once, however often it is added (events coalesce);
* a key being processed is never handed to a second worker; added meanwhile, it is processed
  again after `done`;
* a failed key comes back after a per-key exponential backoff (`retry`), reset by `forget`;
  an `add` (a new event) brings it back at once.

Everything runs on one asyncio loop; the reconciles themselves run in threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class ShutDown(Exception):
    """`get` on a queue that was shut down."""


class WorkQueue(Generic[K]):
    def __init__(self, base_delay: float = 1.0, max_delay: float = 60.0) -> None:
        if not 0 < base_delay <= max_delay:
            raise ValueError(f"base_delay: must be > 0 and <= max_delay, not {base_delay}")
        self.base_delay, self.max_delay = base_delay, max_delay
        self._order: list[K] = []  # waiting keys, oldest first; each once
        self._processing: set[K] = set()
        self._dirty: set[K] = set()  # added while processing: goes back on `done`
        self._failures: dict[K, int] = {}
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._wakeup = asyncio.Event()
        self._shut_down = False

    def __len__(self) -> int:
        return len(self._order)

    def add(self, key: K) -> None:
        if self._shut_down:
            return
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._order:
            self._order.append(key)
            self._wakeup.set()

    def add_after(self, key: K, delay: float) -> None:
        """`add` in `delay` seconds; an earlier pending `add_after` for the key is replaced."""
        if self._shut_down:
            return
        if (old := self._timers.pop(key, None)) is not None:
            old.cancel()
        self._timers[key] = asyncio.get_running_loop().call_later(delay, self._fire, key)

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def retry(self, key: K) -> float:
        """Count a failure of `key` and add it after the backoff that count earns; the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = min(self.base_delay * 2.0 ** failures, self.max_delay)
        self.add_after(key, delay)
        return delay

    def failures(self, key: K) -> int:
        """Failures in a row so far (0 after `forget`)."""
        return self._failures.get(key, 0)

    def forget(self, key: K) -> None:
        """The key succeeded (or is gone): its next failure starts the backoff afresh."""
        self._failures.pop(key, None)

    def drop(self, key: K) -> None:
        """The object is gone: no retry, no waiting entry."""
        self.forget(key)
        if (timer := self._timers.pop(key, None)) is not None:
            timer.cancel()
        if key in self._order:
            self._order.remove(key)
        self._dirty.discard(key)

    async def get(self) -> K:
        while not self._order or self._shut_down:
            if self._shut_down:
                raise ShutDown
            self._wakeup.clear()
            await self._wakeup.wait()
        key = self._order.pop(0)
        self._processing.add(key)
        return key

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def shut_down(self) -> None:
        self._shut_down = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._wakeup.set()
