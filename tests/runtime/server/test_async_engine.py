"""`AsyncEngine` over a real engine core process running a fake engine (tests/support/fake_engine.py):
ordering, idling, aborts, the queue limit, crashes and a killed core."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
from fake_engine import TOKENS, FakeEngine

from kvpilot.runtime.engine.engine import RequestError
from kvpilot.runtime.errors import RequestFailedError
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError

HI = [TOKENS["hi"]]


async def _started(**kwargs: Any) -> AsyncEngine:
    engine = AsyncEngine(None, engine_factory=FakeEngine, **kwargs)
    await asyncio.wait_for(engine.start(), timeout=120)
    return engine


async def _tokens(engine: AsyncEngine, request_id: str, prompt: list[int]) -> list[list[int]]:
    stream = await engine.add_request(request_id, prompt, SamplingParams())
    return [out.outputs[0].token_ids async for out in stream]


async def test_outputs_arrive_in_order_and_end_finished_and_the_core_idles() -> None:
    engine = await _started()
    try:
        results = await asyncio.wait_for(asyncio.gather(*(_tokens(engine, f"r{i}", HI) for i in range(3))), 60)
        for seen in results:  # cumulative outputs, the latest of each read: growing prefixes of the whole
            assert seen[-1] == [10, 11, 12]
            assert all(a == seen[-1][:len(a)] and len(a) < len(b) for a, b in zip(seen, seen[1:], strict=False))
        assert engine.num_pending_requests == 0
        steps = (await engine.live_config())["num_steps"]
        await asyncio.sleep(0.3)
        assert (await engine.live_config())["num_steps"] == steps  # no work: the core does not step
        assert engine.snapshot.num_free_blocks == engine.snapshot.num_blocks == 8
    finally:
        await engine.stop()


async def test_bad_requests_are_raised_at_admission_with_their_type() -> None:
    engine = await _started()
    try:
        with pytest.raises(RequestError, match="empty"):
            await engine.add_request("r", [], SamplingParams())
        with pytest.raises(RuntimeError, match="KeyError"):  # not a ValueError: still reaches the caller
            await asyncio.wait_for(engine.add_request("x", [TOKENS["explode"]], SamplingParams()), 10)
        with pytest.raises(RequestError, match="no tokenizer"):
            await engine.add_request("t", "text needs a tokenizer", SamplingParams())
        with pytest.raises(ValueError, match="block_size"):
            await engine.update_config({"block_size": 8})
        assert engine.num_pending_requests == 0
        assert (await asyncio.wait_for(_tokens(engine, "y", HI), 30))[-1] == [10, 11, 12]
    finally:
        await engine.stop()


async def test_queue_limit_rejects_beyond_max_queue_len() -> None:
    engine = await _started(max_queue_len=1)
    try:
        await engine.add_request("a", [TOKENS["hold"]], SamplingParams())
        with pytest.raises(QueueFullError):
            await engine.add_request("b", HI, SamplingParams())
        engine.abort("a")
    finally:
        await engine.stop()


async def test_abort_reaches_the_core_and_frees_its_blocks() -> None:
    engine = await _started()
    try:
        await engine.add_request("a", [TOKENS["hold"]], SamplingParams())
        assert engine.snapshot.num_free_blocks == 7
        engine.abort("a")
        for _ in range(500):
            if engine.snapshot.num_free_blocks == 8:
                break
            await asyncio.sleep(0.01)
        assert engine.snapshot.num_free_blocks == 8 and engine.snapshot.num_requests == 0
        assert (await engine.live_config())["aborted"] == ["a"]
        assert engine.num_pending_requests == 0
    finally:
        await engine.stop()


async def test_crash_fails_pending_and_later_requests_with_the_cause() -> None:
    engine = await _started()
    try:
        held = await engine.add_request("a", [TOKENS["hold"]], SamplingParams())
        crashing = await engine.add_request("b", [TOKENS["crash"]], SamplingParams())
        for stream in (held, crashing):
            with pytest.raises(EngineDeadError, match="boom"):
                await asyncio.wait_for(anext(aiter(stream)), timeout=10)
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            await engine.add_request("c", HI, SamplingParams())
        with pytest.raises(EngineDeadError):
            await engine.live_config()
    finally:
        await engine.stop()


@pytest.mark.parametrize("how", ["sigkill", "dies_in_step"])
async def test_a_killed_core_fails_every_open_request(how: str) -> None:
    engine = await _started()
    try:
        streams = [await engine.add_request(f"h{i}", [TOKENS["hold"]], SamplingParams()) for i in range(3)]
        if how == "sigkill":
            assert engine.core_pid is not None
            os.kill(engine.core_pid, signal.SIGKILL)
        else:
            # the core may die before its acknowledgement leaves it (ZeroMQ sends from its own
            # thread): then the admission itself fails the same way
            try:
                streams.append(await engine.add_request("d", [TOKENS["die"]], SamplingParams()))
            except EngineDeadError as error:
                assert "exited unexpectedly" in str(error)
        for stream in streams:
            with pytest.raises(EngineDeadError, match="exited unexpectedly"):
                await asyncio.wait_for(anext(aiter(stream)), timeout=10)
        assert not engine.is_alive and engine.num_pending_requests == 0
    finally:
        await engine.stop()


async def test_prompts_of_one_request_are_admitted_all_or_none_within_the_queue() -> None:
    engine = await _started(max_queue_len=3)
    try:
        await engine.add_request("a", [TOKENS["hold"]], SamplingParams())
        held = [(None, [TOKENS["hold"]])]
        with pytest.raises(QueueFullError, match="1 of 3 requests waiting, 3 more asked"):
            await engine.add_requests(["b0", "b1", "b2"], held * 3, SamplingParams())
        assert engine.num_pending_requests == 1
        assert len(await engine.add_requests(["c0", "c1"], held * 2, SamplingParams())) == 2
        assert engine.snapshot.num_waiting_requests == 3  # the core holds a, c0, c1 and none of b
    finally:
        await engine.stop()


async def test_a_request_the_core_message_cannot_carry_leaves_nothing_pending() -> None:
    engine = await _started()
    try:
        with pytest.raises(ValueError, match="cannot receive"):
            await engine.add_requests(["big-id"], [(None, [2**70])], SamplingParams())
        with pytest.raises(ValueError, match="cannot receive"):
            await engine.add_requests(["big-priority"], [(None, HI)], SamplingParams(), priority=2**70)
        assert engine.num_pending_requests == 0 and engine.is_alive
        assert (await _tokens(engine, "after", HI))[-1] == [10, 11, 12]
    finally:
        await engine.stop()


async def test_a_stream_holds_only_the_latest_output_while_nobody_reads() -> None:
    engine = await _started()
    try:
        stream = await engine.add_request("unread", HI, SamplingParams())
        while engine.num_pending_requests:  # the request runs to its end, nobody reading
            await asyncio.sleep(0.01)
        assert [out.outputs[0].token_ids async for out in stream] == [[10, 11, 12]]
    finally:
        await engine.stop()


async def test_a_request_the_core_ends_on_an_error_fails_alone() -> None:
    engine = await _started()
    try:
        failing = await engine.add_request("f", [TOKENS["fail"]], SamplingParams())
        others = [asyncio.ensure_future(_tokens(engine, f"ok{i}", HI)) for i in range(2)]
        with pytest.raises(RequestFailedError, match="sampling this request failed"):
            await asyncio.wait_for(failing.get(), timeout=10)
        assert [seen[-1] for seen in await asyncio.gather(*others)] == [[10, 11, 12]] * 2
        assert engine.is_alive and engine.num_pending_requests == 0
    finally:
        await engine.stop()
