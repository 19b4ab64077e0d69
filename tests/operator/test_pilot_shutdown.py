"""The pilots at the operator's shutdown: a reconcile that ends after them starts none, and
stopping one lets a cancellation of the caller through."""

from __future__ import annotations

import asyncio
import contextlib
from typing import cast

import aiohttp
import pytest

from kvpilot.operator.autoscale import ScalingSpec
from kvpilot.operator.autotune import EngineLimits, TuningSpec
from kvpilot.operator.key import Key
from kvpilot.operator.kube import Kube
from kvpilot.operator.manifests import Owner
from kvpilot.operator.pilot import Pilot, Pilots, PilotSettings

KEY = Key("serving", "llama")
SETTINGS = PilotSettings(Owner(name="llama", namespace="serving", uid="0b8e7c9e-1111-2222-3333-444455556666"),
                         TuningSpec(enabled=True), ScalingSpec(), EngineLimits(4, 2048, True), "operator-0")
NO_KUBE = cast(Kube, None)  # neither test reaches the API server


async def test_a_reconcile_that_ends_after_the_pilots_closed_starts_no_pilot() -> None:
    pilots = Pilots(NO_KUBE, "operator-0", poke=lambda key: None)
    await pilots.close()
    # what a worker thread still in its reconcile does once it is done
    await asyncio.to_thread(pilots.sync, KEY, SETTINGS, {})
    await asyncio.sleep(0.05)  # the loop runs the call the thread scheduled
    assert pilots.pilots == {} and pilots.view(KEY) is None


async def test_stopping_a_pilot_lets_the_callers_cancellation_through() -> None:
    release = asyncio.Event()

    async def slow_to_end() -> None:  # a pass that takes a while to unwind once cancelled
        try:
            await asyncio.sleep(3600)
        finally:
            await release.wait()

    async with aiohttp.ClientSession() as session:
        pilot = Pilot(KEY, NO_KUBE, session, SETTINGS, {}, None, poke=lambda key: None)
        pilot._task = asyncio.create_task(slow_to_end())
        await asyncio.sleep(0)
        stopping = asyncio.create_task(pilot.stop())
        await asyncio.sleep(0.05)
        stopping.cancel()
        # the shutdown was cancelled: it ends now, cancelled, not once the pass has unwound
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(stopping, timeout=1.0)
        assert stopping.cancelled() and not pilot._task.done()
        release.set()
        with contextlib.suppress(asyncio.CancelledError):
            await pilot._task


async def test_a_pilot_stopped_in_the_turn_it_is_woken_stops() -> None:
    """A wake-up (a spec change) and Pilot.stop's cancellation in one turn of the event loop: the
    loop of passes ends all the same. (Python 3.11's wait_for returned the wake-up and dropped the
    cancellation: the loop went on and stop waited for it forever.)"""
    async with aiohttp.ClientSession() as session:
        pilot = Pilot(KEY, NO_KUBE, session, SETTINGS, {}, None, poke=lambda key: None)
        passes = 0

        async def run_once() -> None:  # a pass without an API server
            nonlocal passes
            passes += 1

        pilot.run_once = run_once  # type: ignore[method-assign]
        pilot.start()
        task = pilot._task
        assert task is not None
        try:
            await asyncio.sleep(0.05)  # the first pass is done: waiting for the interval or a wake-up
            assert passes == 1
            pilot._wakeup.set()
            task.cancel()
            await asyncio.wait([task], timeout=2.0)
            assert task.cancelled() and passes == 1
        finally:
            while not task.done():  # the old loop: cancel until it takes
                task.cancel()
                await asyncio.wait([task], timeout=0.1)
