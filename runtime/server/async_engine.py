"""`AsyncEngine`: the asyncio front of the engine core, in the API process.

`start()` spawns the engine core (engine/core.py) as its own process (core_process.py) and waits
until it has built its `LLMEngine`; from then on the event loop sends it commands (add, abort,
utility calls) and one reader task receives its per-step messages, turns the token ids into
`RequestOutput`s (output_processor.py: detokenizing, stop strings) and hands each to its request's
*stream* (streams.py), which keeps the latest. Prompts are tokenized here (off the event loop), so the core sees token ids only;
the prompts of one HTTP request are admitted together, all or none.

The core is *dead* when its step loop raises (it says why before exiting) or its process exits
unasked (killed, out of memory): every open stream and every later request fails at once with
`EngineDeadError`, and `/health` reports it, instead of requests hanging. The core exits by
itself when this process disappears.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import time
from collections.abc import Callable, Collection
from typing import Any

import msgspec

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    CoreDead,
    CoreOutput,
    CoreOutputs,
    EngineSnapshot,
    QueueFullError,
    Ready,
    Shutdown,
    StepStatsMsg,
    UtilityCall,
    UtilityResult,
    error_of,
)
from kvpilot.runtime.errors import EngineDeadError, RequestError
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.sequence import DEFAULT_TENANT
from kvpilot.runtime.server.core_process import CoreProcess
from kvpilot.runtime.server.output_processor import OutputProcessor
from kvpilot.runtime.server.streams import RequestStream, deliver
from kvpilot.runtime.tokenizer import Tokenizer, encode_prompt

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineSnapshot", "QueueFullError", "RequestStream", "StepHook"]


# Called on the event loop for every message from the core: the outputs it produced, the core's
# snapshot, the step's stats (None after commands) and the ids of the requests still open.
StepHook = Callable[[list[RequestOutput], EngineSnapshot, StepStatsMsg | None, Collection[str]], None]

# how long after the core's process exits unasked to wait for its last words (CoreDead) before
# failing everything with the exit code alone
_DEATH_GRACE_S = 0.1


def _params_fields(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


class AsyncEngine:
    """`config` is the `EngineConfig` the core builds its engine from; `engine_factory(config)`
    (a picklable callable, default `LLMEngine`) builds it in the core process."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None, max_queue_len: int | None = None,
                 on_step: StepHook | None = None, engine_factory: Callable[[EngineConfig], Any] | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_queue_len = max_queue_len
        self.on_step = on_step
        self.engine_factory = engine_factory
        self.error: BaseException | None = None
        self.snapshot = EngineSnapshot()
        self.vocab_size: int | None = None  # the model's, told by the core when it is ready
        self.core_pid: int | None = None
        self.core_startup: list[dict[str, Any]] = []  # the core's start-up phases, from its Ready
        self._processor = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._admissions: dict[str, asyncio.Future[None]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutput)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._core: CoreProcess | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stopping = False
        self._restarting = False

    # ---- lifecycle -------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the engine core's process, before any event loop runs if need be: `kvpilot serve`
        calls this first, so the core imports torch and builds its engine while this process
        imports the server and loads the tokenizer. The core connects to sockets that `start()`
        binds later (ZeroMQ queues its messages until then)."""
        if self._core is not None:
            return
        self._core = CoreProcess(self.config, self.max_queue_len, self.engine_factory)
        self.core_pid = self._core.proc.pid

    def abandon(self) -> None:
        """Kill a core that `spawn()` started and `start()` never waited for (the server failed to
        come up): multiprocessing would otherwise wait for it at exit."""
        core, self._core = self._core, None
        if core is not None:
            core.kill()

    def attach_tokenizer(self, tokenizer: Tokenizer | None) -> None:
        """The tokenizer, loaded after `spawn()` (it takes seconds that the core's start overlaps)."""
        self._use(self.config, tokenizer)

    async def start(self) -> None:
        """Spawn the engine core (unless `spawn()` did) and wait until its engine is built; raises
        `EngineDeadError` if it fails to start."""
        loop = self._loop = asyncio.get_running_loop()
        self.error = None
        self._stopping = False
        self.spawn()
        assert self._core is not None
        self._core.bind()
        self._ready = loop.create_future()
        proc = self._core.proc
        loop.add_reader(proc.sentinel, self._on_core_exit, proc)
        self._reader = asyncio.create_task(self._read_loop())
        try:
            await self._ready
        except BaseException:
            # nothing may outlive a failed start: a context left with open sockets blocks in
            # `term()` whenever the garbage collector reaches it, on whatever thread that is
            await self.stop()
            raise
        finally:
            self._ready = None
        logger.info("engine core ready (pid %d)", proc.pid)

    async def stop(self) -> None:
        """Stop the core (it frees its device memory and tensor-parallel workers) and close."""
        core = self._core
        if core is None:
            return
        self._stopping = True
        assert self._loop is not None
        self._loop.remove_reader(core.proc.sentinel)
        await core.join(self._loop, self._encoder.encode(Shutdown()))
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        core.close()
        self._core = None

    async def reload(self, config: EngineConfig, tokenizer: Tokenizer | None) -> None:
        """Replace the core by one built from `config`, while no request is in flight. The old core
        exits (releasing its memory) before the new one starts; if the new one fails, the old
        configuration is started again and the error is raised."""
        old = (self.config, self.tokenizer)
        self._restarting = True
        try:
            await self.stop()
            self._use(config, tokenizer)
            try:
                await self.start()
            except BaseException:
                await self.stop()
                self._use(*old)
                await self.start()
                raise
        finally:
            self._restarting = False

    def _use(self, config: EngineConfig, tokenizer: Tokenizer | None) -> None:
        self.config, self.tokenizer = config, tokenizer
        self._processor = OutputProcessor(tokenizer)

    @property
    def _proc(self) -> multiprocessing.process.BaseProcess | None:
        return self._core.proc if self._core is not None else None

    @property
    def is_alive(self) -> bool:
        if self._restarting:
            return self.error is None
        return self.error is None and self._proc is not None and self._proc.is_alive()

    @property
    def num_pending_requests(self) -> int:
        """Requests admitted and not yet finished (streams still open)."""
        return len(self._streams)

    # ---- requests --------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, tenant: str = DEFAULT_TENANT) -> RequestStream:
        """Admit one request (a text prompt is tokenized off the event loop); raises
        `RequestError`, `QueueFullError`, `ValueError` or `EngineDeadError`."""
        encoded = await asyncio.get_running_loop().run_in_executor(None, encode_prompt, self.tokenizer, prompt)
        (stream,) = await self.add_requests([request_id], [encoded], params, priority, tenant)
        return stream

    async def add_requests(self, request_ids: list[str], prompts: list[tuple[str | None, list[int]]],
                           params: SamplingParams, priority: int = 0,
                           tenant: str = DEFAULT_TENANT) -> list[RequestStream]:
        """Admit one request per (text, token ids) prompt, all or none, in one message to the core
        (so they fit `--max-queue-len` together and none waits for another's step); raises as
        `add_request`. Nothing stays registered when they are refused or cannot be sent."""
        self._check_alive()
        assert self._loop is not None, "start() first"
        taken = [r for r in request_ids if r in self._streams]
        if taken or len(set(request_ids)) != len(request_ids):
            raise RequestError(f"request id {(taken or request_ids)[0]!r} is already in use")
        arrival = time.time()
        fields = _params_fields(params)
        try:  # encoded before anything is registered: a value msgpack cannot carry leaves no trace
            message = self._encoder.encode(AddRequests([
                AddRequest(request_id, token_ids, fields, arrival, priority, tenant)
                for request_id, (_, token_ids) in zip(request_ids, prompts, strict=True)]))
        except (OverflowError, TypeError, msgspec.EncodeError) as e:
            raise ValueError(f"the request holds a value the engine core cannot receive: {e}") from None
        admitted: asyncio.Future[None] = self._loop.create_future()
        self._admissions[request_ids[0]] = admitted
        streams = [RequestStream(request_id) for request_id in request_ids]
        for stream, (text, token_ids) in zip(streams, prompts, strict=True):
            self._streams[stream.request_id] = stream
            self._processor.add(stream.request_id, text, token_ids, params, arrival, priority)
        self._send_encoded(message)
        try:
            await admitted
        except BaseException:
            self._admissions.pop(request_ids[0], None)
            cancelled = admitted.cancelled()
            for request_id in request_ids:
                self._processor.remove(request_id)
                self._streams.pop(request_id, None)
            if cancelled and self.error is None:
                self._send(AbortRequests(request_ids))
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request; the core frees its blocks before its next step."""
        if self._streams.pop(request_id, None) is not None:
            self._processor.remove(request_id)
            if self.error is None and self._core is not None and self._core.input is not None:
                self._send(AbortRequests([request_id]))

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
            stream.fail(EngineDeadError("the server shut down before this request finished"))
            self.abort(request_id)

    # ---- utility calls (run in the core between steps) -------------------------------------

    async def live_config(self) -> dict[str, Any]:
        """The live tunables, plus max_model_len and num_blocks."""
        return await self._call("live_config")  # type: ignore[no-any-return]

    async def update_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        """`LLMEngine.update_config` in the core: {"applied": what changed, "relayout": the cost of a
        block-size change (`RelayoutReport.as_dict()`) or None}; raises its `ValueError`s."""
        return await self._call("update_config", changes)  # type: ignore[no-any-return]

    async def device_memory(self) -> dict[str, Any]:
        """The device memory the core sees (its process holds the model and the KV cache)."""
        return await self._call("device_memory")  # type: ignore[no-any-return]

    async def _call(self, method: str, *args: Any) -> Any:
        self._check_alive()
        assert self._loop is not None, "start() first"
        call_id = next(self._call_ids)
        result: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = result
        self._send(UtilityCall(call_id, method, list(args)))
        try:
            return await result
        finally:
            self._calls.pop(call_id, None)

    # ---- plumbing --------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        if self._proc is None:
            raise EngineDeadError("the engine core is not running")

    def _send(self, msg: Any) -> None:
        self._send_encoded(self._encoder.encode(msg))

    def _send_encoded(self, message: bytes) -> None:
        assert self._core is not None
        self._core.send(message)

    async def _read_loop(self) -> None:
        assert self._core is not None and self._core.output is not None
        output = self._core.output
        try:
            while True:
                msg = self._decoder.decode(await output.recv())
                if isinstance(msg, CoreOutputs):
                    self._on_outputs(msg)
                elif isinstance(msg, UtilityResult):
                    future = self._calls.get(msg.call_id)
                    if future is not None and not future.done():
                        if msg.error is None:
                            future.set_result(msg.value)
                        else:
                            future.set_exception(error_of(msg.error, msg.message))
                elif isinstance(msg, Ready):
                    self.snapshot = msg.snapshot
                    self.vocab_size = msg.vocab_size
                    self.core_startup = msg.startup
                    self._publish([], None)
                    if self._ready is not None and not self._ready.done():
                        self._ready.set_result(None)
                elif isinstance(msg, CoreDead):
                    self._fail(EngineDeadError(f"the engine core crashed: {msg.message}"))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a broken message must not leave requests hanging
            logger.exception("reading the engine core's messages failed")
            self._fail(EngineDeadError(f"the engine core's messages could not be read: {error!r}"))

    def _on_outputs(self, msg: CoreOutputs) -> None:
        for ack in msg.acks:
            future = self._admissions.pop(ack.request_id, None)
            if future is None or future.done():
                continue
            if ack.error is None:
                future.set_result(None)
            else:
                future.set_exception(error_of(ack.error, ack.message))
        outputs = deliver(msg.outputs, self._streams, self._processor, self._send)
        self.snapshot = msg.snapshot
        self._publish(outputs, msg.stats)

    def _publish(self, outputs: list[RequestOutput], stats: StepStatsMsg | None) -> None:
        if self.on_step is not None:
            try:
                self.on_step(outputs, self.snapshot, stats, self._streams.keys())
            except Exception:  # noqa: BLE001 - metrics must never break serving
                logger.exception("the step hook failed")

    def _on_core_exit(self, proc: multiprocessing.process.BaseProcess) -> None:
        assert self._loop is not None
        self._loop.remove_reader(proc.sentinel)
        if self._stopping or proc is not self._proc:
            return
        proc.join(0)

        def declare() -> None:
            if proc is self._proc and not self._stopping:
                self._fail(EngineDeadError(f"the engine core process exited unexpectedly (exit code {proc.exitcode})"))
        # give the reader a moment for the core's last words (CoreDead), which name the cause
        self._loop.call_later(_DEATH_GRACE_S, declare)

    def _fail(self, error: EngineDeadError) -> None:
        if self.error is not None:
            return
        logger.error("%s", error)
        self.error = error
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        for future in [*self._admissions.values(), *self._calls.values(), self._ready]:
            if future is not None and not future.done():
                future.set_exception(error)
        self._admissions.clear()
        self._publish([], None)
