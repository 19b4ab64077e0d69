"""The work queue's promises: coalescing, one worker per key, per-key backoff."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.operator.workqueue import ShutDown, WorkQueue


async def test_a_key_added_many_times_waits_once() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in ("a", "b", "a", "a"):
        queue.add(key)
    assert len(queue) == 2
    assert [await queue.get(), await queue.get()] == ["a", "b"]


async def test_a_key_in_progress_is_not_handed_out_again_until_done() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    assert await queue.get() == "a"
    queue.add("a")  # an event while a worker reconciles it
    assert len(queue) == 0
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(queue.get(), timeout=0.05)
    queue.done("a")
    assert await asyncio.wait_for(queue.get(), timeout=1) == "a"  # and then once more


async def test_failures_back_off_exponentially_up_to_the_cap_and_forget_resets() -> None:
    queue: WorkQueue[str] = WorkQueue(base_delay=0.01, max_delay=0.04)
    assert [queue.retry("a") for _ in range(4)] == [0.01, 0.02, 0.04, 0.04]
    assert queue.failures("a") == 4
    queue.forget("a")
    assert queue.retry("a") == 0.01
    assert await asyncio.wait_for(queue.get(), timeout=1) == "a"


async def test_an_event_does_not_wait_for_the_backoff() -> None:
    queue: WorkQueue[str] = WorkQueue(base_delay=30, max_delay=60)
    queue.retry("a")
    queue.add("a")
    assert await asyncio.wait_for(queue.get(), timeout=1) == "a"


async def test_drop_cancels_a_pending_retry() -> None:
    queue: WorkQueue[str] = WorkQueue(base_delay=0.01, max_delay=0.01)
    queue.retry("a")
    queue.drop("a")
    await asyncio.sleep(0.05)
    assert len(queue) == 0 and queue.failures("a") == 0


async def test_shut_down_wakes_the_workers() -> None:
    queue: WorkQueue[str] = WorkQueue()
    waiting = asyncio.create_task(queue.get())
    await asyncio.sleep(0)
    queue.shut_down()
    with pytest.raises(ShutDown):
        await waiting
