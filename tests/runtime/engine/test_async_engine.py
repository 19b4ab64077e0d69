"""`AsyncEngine` on a fake engine: ordering, idling, aborts, the queue limit, and crashes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from kvpilot.runtime.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from kvpilot.runtime.engine.engine import RequestError
from kvpilot.runtime.outputs import CompletionOutput, RequestOutput
from kvpilot.runtime.sampling_params import SamplingParams

NUM_TOKENS = 3


class FakeEngine:
    """Each request emits one token per step and finishes after NUM_TOKENS; `crash` makes step raise."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.scheduler = SimpleNamespace(running=[], waiting=[], swapped=[])
        self.block_manager = SimpleNamespace(num_free_blocks=8, num_blocks=8, usage=0.0)
        self.last_step = None
        self.num_steps = 0
        self.crash = False

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    tenant: str = "default") -> None:
        if prompt == "explode":
            raise KeyError("not a ValueError")
        if not prompt:
            raise RequestError("the prompt is empty")
        self.requests[request_id] = SimpleNamespace(tokens=[], metrics=SimpleNamespace(first_scheduled_time=None))

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.crash:
            raise RuntimeError("boom")
        outputs = []
        for request_id, r in list(self.requests.items()):
            r.metrics.first_scheduled_time = 1.0
            r.tokens.append(len(r.tokens))
            done = len(r.tokens) == NUM_TOKENS
            outputs.append(RequestOutput(request_id, None, [1], [CompletionOutput(
                0, "x" * len(r.tokens), list(r.tokens), None, None, "length" if done else None)], done))
            if done:
                del self.requests[request_id]
        return outputs


async def _started(fake: FakeEngine, **kwargs: Any) -> AsyncEngine:
    engine = AsyncEngine(fake, **kwargs)  # type: ignore[arg-type]
    engine.start()
    return engine


async def test_outputs_arrive_in_order_and_end_finished() -> None:
    engine = await _started(FakeEngine())
    streams = [await engine.add_request(f"r{i}", "hi", SamplingParams()) for i in range(3)]
    for stream in streams:
        texts = [out.outputs[0].text async for out in stream]
        assert texts == ["x", "xx", "xxx"]
    assert engine.num_pending_requests == 0
    await engine.stop()


async def test_engine_thread_idles_without_work() -> None:
    fake = FakeEngine()
    engine = await _started(fake)
    await asyncio.sleep(0.2)
    assert fake.num_steps == 0
    [_ async for _ in await engine.add_request("r", "hi", SamplingParams())]
    steps = fake.num_steps
    await asyncio.sleep(0.2)
    assert fake.num_steps == steps == NUM_TOKENS
    await engine.stop()


async def test_bad_request_is_raised_at_admission() -> None:
    engine = await _started(FakeEngine())
    with pytest.raises(RequestError):
        await engine.add_request("r", "", SamplingParams())
    assert engine.num_pending_requests == 0
    await engine.stop()


async def test_queue_limit_rejects_beyond_max_queue_len() -> None:
    fake = FakeEngine()
    engine = await _started(fake, max_queue_len=1)
    fake.step = lambda: []  # type: ignore[method-assign]  # nothing gets scheduled: requests stay queued
    await engine.add_request("a", "hi", SamplingParams())
    with pytest.raises(QueueFullError):
        await engine.add_request("b", "hi", SamplingParams())
    engine.abort("a")
    await engine.stop()


async def test_abort_reaches_the_engine() -> None:
    fake = FakeEngine()
    fake.step = lambda: []  # type: ignore[method-assign]
    engine = await _started(fake)
    await engine.add_request("a", "hi", SamplingParams())
    engine.abort("a")
    for _ in range(100):
        if not fake.requests:
            break
        await asyncio.sleep(0.01)
    assert not fake.requests and engine.num_pending_requests == 0
    await engine.stop()


async def test_crash_fails_pending_and_later_requests_instead_of_hanging() -> None:
    fake = FakeEngine()
    fake.crash = True
    engine = await _started(fake)
    stream = await engine.add_request("a", "hi", SamplingParams())
    with pytest.raises(EngineDeadError, match="boom"):
        await asyncio.wait_for(anext(aiter(stream)), timeout=5)
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        await engine.add_request("b", "hi", SamplingParams())
    with pytest.raises(EngineDeadError):
        await engine.call(lambda e: None)


async def test_an_unexpected_error_while_admitting_reaches_the_caller() -> None:
    """Only ValueErrors used to be passed back: anything else left the caller waiting forever."""
    engine = await _started(FakeEngine())
    with pytest.raises(KeyError):
        await asyncio.wait_for(engine.add_request("x", "explode", SamplingParams()), timeout=10)
    stream = await engine.add_request("y", "hi", SamplingParams())  # the engine still serves
    assert [out.outputs[0].text async for out in stream] == ["x", "xx", "xxx"]
    assert engine.num_pending_requests == 0
    await engine.stop()
