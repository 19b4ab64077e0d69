"""`AsyncEngine`: the asyncio front of `LLMEngine`.

The engine is not thread-safe, so it lives on one dedicated thread (the *engine thread*) that
runs the step loop. The event loop talks to it only through a thread-safe *inbox* of commands
(add, abort, call), which the engine thread applies between steps; outputs travel back through
`loop.call_soon_threadsafe` into one asyncio queue per request (a *stream*). With no work the
engine thread blocks on the inbox instead of spinning.

If the step loop raises, the engine is *dead*: every pending stream and every later request
fails with `EngineDeadError`, and `/health` reports it, instead of requests hanging forever.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvpilot.runtime.engine.engine import LLMEngine, StepStats
from kvpilot.runtime.engine.scheduler import Scheduler
from kvpilot.runtime.engine.sequence import DEFAULT_TENANT
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has crashed; no request can be served."""


class QueueFullError(RuntimeError):
    """More requests wait for scheduling than `--max-queue-len` allows."""


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after the latest step or command, read by other threads."""

    num_requests: int = 0
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_swapped_seqs: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_cache_usage: float = 0.0
    waiting_requests_by_tenant: dict[str, int] = field(default_factory=dict)  # waiting or swapped out


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    tenant: str
    admitted: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    result: asyncio.Future[Any]


_STOP = object()


@dataclass
class RequestStream:
    """Outputs of one request, in order; ends after the finished output or an error."""

    request_id: str
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


# Called on the engine thread after every step (with its stats) and after commands (stats None).
StepHook = Callable[[LLMEngine, list[RequestOutput], EngineSnapshot, StepStats | None], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None,
                 on_step: StepHook | None = None) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.on_step = on_step
        self.error: BaseException | None = None
        self.snapshot = self._take_snapshot()
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched only on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle (event loop) ------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_pending_requests(self) -> int:
        """Requests admitted and not yet finished (streams still open)."""
        return len(self._streams)

    # ---- requests (event loop) -------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, priority: int = 0,
                          tenant: str = DEFAULT_TENANT) -> RequestStream:
        """Admit a request; raises `RequestError`, `QueueFullError` or `EngineDeadError`."""
        self._check_alive()
        assert self._loop is not None, "start() first"
        stream = RequestStream(request_id)
        admitted: asyncio.Future[None] = self._loop.create_future()
        self._streams[request_id] = stream
        self._inbox.put(_Add(request_id, prompt, params, priority, tenant, admitted))
        try:
            await admitted
        except BaseException:
            self._streams.pop(request_id, None)
            if not admitted.done() or admitted.cancelled():
                self._inbox.put(_Abort(request_id))
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step."""
        if self._streams.pop(request_id, None) is not None:
            self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        self._check_alive()
        assert self._loop is not None, "start() first"
        result: asyncio.Future[Any] = self._loop.create_future()
        self._inbox.put(_Call(fn, result))
        return await result

    async def swap_engine(self, build: Callable[[], LLMEngine]) -> None:
        """Replace the engine, on the engine thread, while no request is in flight. The old engine
        is released before `build` runs, so two never hold device memory at once; if `build`
        fails, the old configuration is loaded again and the error is raised."""
        def swap(old: LLMEngine) -> None:
            from kvpilot.runtime.engine.engine import LLMEngine

            old_config = old.config
            self.engine = None  # type: ignore[assignment]
            del old
            _release_memory()
            try:
                self.engine = build()
            except BaseException:
                _release_memory()
                self.engine = LLMEngine(old_config)
                raise

        await self.call(swap)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no admitted request is left; False if `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while self._streams and self.error is None:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            stream = self._streams[request_id]
            stream.queue.put_nowait(EngineDeadError("the server shut down before this request finished"))
            self.abort(request_id)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine loop crashed: {self.error!r}")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            stream.queue.put_nowait(out)
            if out.finished:
                stream.finished = True
                del self._streams[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine loop crashed: {error!r}")
        for stream in self._streams.values():
            stream.queue.put_nowait(dead)
        self._streams.clear()
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add | _Call):
                future = cmd.admitted if isinstance(cmd, _Add) else cmd.result
                if not future.done():
                    future.set_exception(dead)

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._publish([], None)
            while True:
                if not self._apply_commands(block=not self.engine.has_unfinished_requests()):
                    return
                if not self.engine.has_unfinished_requests():
                    self._publish([], None)
                    continue
                outputs = self.engine.step()
                self._publish(outputs, self.engine.last_step)
                if outputs:
                    assert self._loop is not None
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
                elif self.engine.last_step is None:
                    time.sleep(0.001)  # nothing schedulable this instant; don't spin hot
        except BaseException as error:  # noqa: BLE001 - any crash must fail requests, not hang them
            logger.exception("the engine loop crashed")
            self.error = error
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail_all, error)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; False when asked to stop."""
        while True:
            try:
                cmd = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                return False
            if isinstance(cmd, _Add):
                self._apply_add(cmd)
            elif isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_id)
            elif isinstance(cmd, _Call):
                self._apply_call(cmd)

    def _apply_add(self, cmd: _Add) -> None:
        error: BaseException | None = None
        if self.max_queue_len is not None and self._num_queued_requests() >= self.max_queue_len:
            error = QueueFullError(
                f"the server's queue is full ({self.max_queue_len} requests waiting); retry later")
        else:
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, priority=cmd.priority,
                                        tenant=cmd.tenant)
            except Exception as e:  # noqa: BLE001 - any failure goes back to the caller, never hangs it
                error = e
        self._resolve(cmd.admitted, None, error)

    def _apply_call(self, cmd: _Call) -> None:
        try:
            value, error = cmd.fn(self.engine), None
        except Exception as e:  # noqa: BLE001 - handed back to the caller
            value, error = None, e
        self._resolve(cmd.result, value, error)
        self._publish([], None)

    def _resolve(self, future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(settle)

    def _num_queued_requests(self) -> int:
        return sum(1 for r in self.engine.requests.values() if r.metrics.first_scheduled_time is None)

    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        bm = e.block_manager
        return EngineSnapshot(
            num_requests=e.num_unfinished_requests,
            num_running_seqs=len(e.scheduler.running),
            num_waiting_seqs=len(e.scheduler.waiting),
            num_swapped_seqs=len(getattr(e.scheduler, "swapped", ())),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            waiting_requests_by_tenant=_waiting_by_tenant(e.scheduler),
        )

    def _publish(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        self.snapshot = self._take_snapshot()
        if self.on_step is not None:
            self.on_step(self.engine, outputs, self.snapshot, stats)


def _waiting_by_tenant(scheduler: Scheduler) -> dict[str, int]:
    waiting = {s.request for s in itertools.chain(scheduler.waiting, scheduler.swapped)}
    return dict(collections.Counter(r.tenant for r in waiting))


def _release_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
