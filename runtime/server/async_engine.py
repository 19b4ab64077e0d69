"""`AsyncEngine`: the asyncio front of the engine core, in the API process.

`start()` spawns the engine core (engine/core.py) as its own process and waits until it has built its
`LLMEngine`; from then on the event loop sends it commands (add, abort, utility calls) and one
reader task receives its per-step messages, turns the token ids into `RequestOutput`s
(output_processor.py: detokenizing, stop strings) and hands each to its request's *stream*, which
keeps the latest. Prompts are tokenized here (off the event loop), so the core sees token ids only;
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
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.core import run_core
from kvpilot.runtime.engine.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    CoreDead,
    CoreOutput,
    CoreOutputs,
    EngineSnapshot,
    FinishSeqs,
    QueueFullError,
    Ready,
    Shutdown,
    StepStatsMsg,
    UtilityCall,
    UtilityResult,
    error_of,
)
from kvpilot.runtime.errors import EngineDeadError, RequestError, RequestFailedError
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.sequence import DEFAULT_TENANT
from kvpilot.runtime.server.output_processor import OutputProcessor
from kvpilot.runtime.tokenizer import Tokenizer, encode_prompt

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineSnapshot", "QueueFullError", "RequestStream", "StepHook"]


class RequestStream:
    """The outputs of one request, in order, ending after the finished one or an error. Outputs
    are cumulative, so only the latest unread one is kept (as vLLM's output collector does): a
    client that reads slowly holds one output, not a queue of them."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._output = output  # replaces one not read yet: it holds everything that one did
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The latest output not read yet (waiting for one); raises the stream's error."""
        await self._ready.wait()
        if self._error is not None:
            raise self._error
        output, self._output = self._output, None
        self._ready.clear()
        assert output is not None
        return output

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            output = await self.get()
            yield output
            if output.finished:
                return


# Called on the event loop for every message from the core: the outputs it produced, the core's
# snapshot, the step's stats (None after commands) and the ids of the requests still open.
StepHook = Callable[[list[RequestOutput], EngineSnapshot, StepStatsMsg | None, Collection[str]], None]

# how long after the core's process exits unasked to wait for its last words (CoreDead) before
# failing everything with the exit code alone
_DEATH_GRACE_S = 0.1
_STOP_TIMEOUT_S = 30.0


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
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._input: zmq.asyncio.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None
        self._ipc_dir: str | None = None
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
        if self._proc is not None:
            return
        self._ipc_dir = tempfile.mkdtemp(prefix="kvpilot-core-")
        # not a daemon: the core starts its own processes for tensor parallelism
        proc = self._proc = multiprocessing.get_context("spawn").Process(
            target=run_core, name="kvpilot-engine-core", daemon=False,
            args=(self.config, f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output", self.max_queue_len,
                  self.engine_factory, logging.getLogger("kvpilot").getEffectiveLevel()))
        proc.start()
        self.core_pid = proc.pid

    def abandon(self) -> None:
        """Kill a core that `spawn()` started and `start()` never waited for (the server failed to
        come up): multiprocessing would otherwise wait for it at exit."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.join()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

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
        ctx = self._ctx = zmq.asyncio.Context()
        self._input = ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(f"ipc://{self._ipc_dir}/input")
        self._output = ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(f"ipc://{self._ipc_dir}/output")
        self._ready = loop.create_future()
        proc = self._proc
        assert proc is not None
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
        proc = self._proc
        if proc is None:
            return
        self._stopping = True
        assert self._loop is not None
        self._loop.remove_reader(proc.sentinel)
        if proc.is_alive() and self._input is not None:
            self._send(Shutdown())
            await self._loop.run_in_executor(None, proc.join, _STOP_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("the engine core did not stop in %.0f s: killing it", _STOP_TIMEOUT_S)
                proc.kill()
                await self._loop.run_in_executor(None, proc.join)
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        for sock in (self._input, self._output):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        self._proc = self._ctx = self._input = self._output = self._ipc_dir = None

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
            if self.error is None and self._input is not None:
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
        assert self._input is not None
        self._input.send(message, copy=False)

    async def _read_loop(self) -> None:
        assert self._output is not None
        try:
            while True:
                msg = self._decoder.decode(await self._output.recv())
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
        outputs: list[RequestOutput] = []
        for delta in msg.outputs:
            stream = self._streams.get(delta.request_id)
            if stream is None:  # aborted meanwhile
                continue
            out, stopped = self._processor.process(delta)
            if out is None:
                continue
            if delta.error is not None:  # the core ended this request alone
                stream.fail(RequestFailedError(f"the engine failed this request: {delta.error}"))
                del self._streams[delta.request_id]
                continue
            if stopped and not out.finished:
                self._send(FinishSeqs(delta.request_id, stopped))
            elif out.finished and not delta.finished:
                self._send(AbortRequests([delta.request_id]))  # ended here at a stop string
            outputs.append(out)
            stream.put(out)
            if out.finished:
                stream.finished = True
                del self._streams[delta.request_id]
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
