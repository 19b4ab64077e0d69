"""The engine core of `kvpilot serve`: the step loop in its own process, and the messages it
exchanges with the API process.

The API process (HTTP, chat templates, tokenising, detokenising, streaming) and the core (schedule,
run, sample) share no GIL. They talk over two ZeroMQ sockets on local IPC paths, one per
direction, with msgspec's MessagePack encoding of the small structs below: token ids in, token
ids out, never a pickled object on the hot path. The core batches what one step produced into
one `CoreOutputs` message: for each request touched, each sample's *new* token ids, its finish
reason and, when asked, the logprobs of those tokens (and the prompt's new logprob entries);
plus the step's stats and a snapshot of the scheduler and KV cache for `/health` and `/metrics`.
Commands (add, abort, finish samples, utility calls) are applied between steps; admissions are
acknowledged at once, before the next step, so a bad request is refused before its HTTP
response starts.

The core runs `LLMEngine` with `detokenize = False`: the API process turns tokens into text and
ends a sample at a stop string (telling the core with `FinishSeqs`). It exits when told to, when
its step loop raises (after sending `CoreDead` with the reason), or when the API process is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvpilot.runtime.sched.sequence import DEFAULT_TENANT

logger = logging.getLogger(__name__)


# ---- API process -> core ----------------------------------------------------------------------

class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams' constructor arguments
    arrival_time: float
    priority: int = 0
    tenant: str = DEFAULT_TENANT  # whom it is served for (the fair policy, per-tenant metrics)


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class FinishSeqs(msgspec.Struct, tag="finish", array_like=True):
    """Samples the API process ended at a stop string: free their blocks."""

    request_id: str
    indices: list[int]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str  # one of UTILITIES
    args: list[Any]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = AddRequest | AbortRequests | FinishSeqs | UtilityCall | Shutdown


# ---- core -> API process ----------------------------------------------------------------------

class EngineSnapshot(msgspec.Struct, frozen=True, array_like=True):
    """The scheduler's and KV cache's state after the latest step or command."""

    num_requests: int = 0
    num_waiting_requests: int = 0  # admitted, never scheduled yet
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_swapped_seqs: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_cache_usage: float = 0.0
    block_size: int = 0
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = False
    waiting_requests_by_tenant: dict[str, int] = {}  # requests waiting or swapped out, per tenant
    warming_up: bool = False  # start-up work left for after Ready still runs (engine/warm_up.py)


class StepStatsMsg(msgspec.Struct, array_like=True):
    duration_s: float
    num_batched_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    num_swapped_out: int
    swap_out_bytes: int
    swap_in_bytes: int
    swap_out_seconds: float = 0.0  # device time of the swap copies that completed
    swap_in_seconds: float = 0.0
    served_tokens: dict[str, list[int]] = {}  # tenant -> [prompt tokens, generated tokens] this step


class SeqDelta(msgspec.Struct, array_like=True):
    index: int
    token_ids: list[int]  # new since the last message
    # per new token: [(token id, logprob, rank), ...], the sampled token first; None unless asked
    logprobs: list[list[tuple[int, float, int]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    seqs: list[SeqDelta]
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int
    finished: bool
    # prompt logprobs asked: the entries new since the last message, as SeqDelta.logprobs' (the
    # first prompt token, which has none, is not sent)
    prompt_logprobs: list[list[tuple[int, float, int]]] | None = None


class Ack(msgspec.Struct, array_like=True):
    request_id: str
    error: str | None = None  # an error kind of ERRORS; None: admitted
    message: str = ""


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[RequestDelta]
    snapshot: EngineSnapshot
    stats: StepStatsMsg | None = None
    acks: list[Ack] = []


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    value: Any = None
    error: str | None = None
    message: str = ""


class Ready(msgspec.Struct, tag="ready", array_like=True):
    snapshot: EngineSnapshot
    pid: int
    startup: list[dict[str, Any]] = []  # the core's start-up phases (runtime/startup.py)


class CoreDead(msgspec.Struct, tag="dead", array_like=True):
    message: str


CoreOutput = CoreOutputs | UtilityResult | Ready | CoreDead


# ---- the core process -------------------------------------------------------------------------

def _live_config(engine: Any) -> dict[str, Any]:
    c = engine.config
    out = dict(engine.live_config())
    out.update(max_model_len=c.model.max_model_len, num_blocks=engine.block_manager.num_blocks)
    return out


def _update_config(engine: Any, changes: dict[str, Any]) -> dict[str, Any]:
    """{"applied": what changed, "relayout": what a block-size change cost, else None}."""
    applied = engine.update_config(changes)
    report = getattr(engine, "last_relayout", None) if "block_size" in applied else None
    return {"applied": applied, "relayout": report.as_dict() if report is not None else None}


def device_memory(device: str) -> dict[str, Any]:
    """What /health shows of the device the engine runs on, measured in the core's process."""
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        return {"type": "cuda", "name": torch.cuda.get_device_name(), "memory_used_bytes": total - free,
                "memory_total_bytes": total, "memory_allocated_bytes": torch.cuda.memory_allocated()}
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"type": "cpu", "process_rss_bytes": rss, "memory_total_bytes": total}


UTILITIES: dict[str, Callable[..., Any]] = {
    "live_config": _live_config,
    "update_config": lambda engine, changes: _update_config(engine, changes),
    "device_memory": lambda engine: device_memory(engine.config.device.device),
}


def error_kind(error: BaseException) -> tuple[str, str]:
    """(kind, message) of an exception that crosses to the API process."""
    from kvpilot.runtime.errors import RequestError

    if isinstance(error, QueueFullError):
        return "queue_full", str(error)
    if isinstance(error, RequestError):
        return "request", str(error)
    if isinstance(error, ValueError):
        return "value", str(error)
    return "internal", f"{type(error).__name__}: {error}"


class QueueFullError(RuntimeError):
    """More requests wait for scheduling than `--max-queue-len` allows."""


def run_core(config: Any, input_addr: str, output_addr: str, max_queue_len: int | None,
             engine_factory: Callable[[Any], Any] | None = None, log_level: int = logging.INFO) -> None:
    """The core process's entry point (spawned by `AsyncEngine`)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    import signal

    import zmq

    # Ctrl-C reaches the whole process group and a pod's SIGTERM may too: the API process decides
    # when the core stops (after draining), so the core ignores both
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    parent = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)
    outbox.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    engine = None
    try:
        if engine_factory is None:
            from kvpilot.runtime.engine.engine import LLMEngine

            engine_factory = LLMEngine
        from kvpilot.runtime.startup import starting_phase

        imports = starting_phase("core_imports", "core")
        engine = engine_factory(config)
        engine.detokenize = False
        # the step hands back its touched `Request`s as they are: the core reads only their new
        # tokens, instead of copying every sample's whole output into a `RequestOutput` each step
        engine.make_output = _as_is
        core = EngineCore(engine, max_queue_len, inbox, lambda msg: outbox.send(encoder.encode(msg)), parent)
        startup = getattr(engine, "startup", None)
        phases = [imports, *(startup.phases if startup is not None else [])]
        outbox.send(encoder.encode(Ready(core.snapshot(), os.getpid(), [dataclasses.asdict(p) for p in phases])))
        core.run()
    except BaseException as error:  # noqa: BLE001 - the API process must learn why, then we exit
        logger.exception("the engine core crashed")
        outbox.send(encoder.encode(CoreDead(f"{type(error).__name__}: {error}")))
        raise SystemExit(1) from None
    finally:
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
        inbox.close(linger=0)
        outbox.close()
        ctx.term()


class EngineCore:
    """The step loop: apply commands, step, send what the step produced; block when idle."""

    POLL_MS = 500  # while idle, how often to check that the API process still lives

    def __init__(self, engine: Any, max_queue_len: int | None, inbox: Any, send: Callable[[Any], Any],
                 parent_pid: int) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.inbox = inbox
        self.send = send
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        # request id -> per sample, the output tokens sent (None once its end was sent)
        self._sent: dict[str, list[int | None]] = {}
        self._wants_logprobs: set[str] = set()
        self._prompt_sent: dict[str, int] = {}  # prompt logprobs asked: entries sent (the first is None)

    def run(self) -> None:
        import zmq

        engine = self.engine
        warm_up = getattr(engine, "warm_up", None)  # start-up work left for after Ready (warm_up.py)
        while True:
            idle = not engine.has_unfinished_requests()
            later = warm_up if warm_up is not None and warm_up.pending else None
            if idle and not self.inbox.poll(0 if later else self.POLL_MS):
                if later is not None:
                    later.run_one(idle=True)
                    if not later.pending:  # done: the API process learns it now, not at the next request
                        self.send(CoreOutputs([], self.snapshot()))
                elif os.getppid() != self.parent_pid:
                    logger.warning("the API process is gone: the engine core exits")
                    return
                continue
            acks: list[Ack] = []
            touched = False
            while True:
                try:
                    raw = self.inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = self.decoder.decode(raw)
                if isinstance(msg, Shutdown):
                    return
                touched = True
                self._apply(msg, acks)
            if touched:
                self.send(CoreOutputs([], self.snapshot(), None, acks))
            if not engine.has_unfinished_requests():
                continue
            outputs = engine.step()
            stats = engine.last_step
            if later is not None:
                later.run_if_due(idle=False)
            if outputs or stats is not None:
                self.send(CoreOutputs(self._deltas(outputs), self.snapshot(), _stats_msg(stats)))
            else:
                time.sleep(0.001)  # nothing schedulable this instant; don't spin hot
            if os.getppid() != self.parent_pid:
                logger.warning("the API process is gone: the engine core exits")
                return

    # ---- commands --------------------------------------------------------------------------

    def _apply(self, msg: Any, acks: list[Ack]) -> None:
        if isinstance(msg, AddRequest):
            acks.append(self._add(msg))
        elif isinstance(msg, AbortRequests):
            for request_id in msg.request_ids:
                self.engine.abort_request(request_id)
                self._forget(request_id)
        elif isinstance(msg, FinishSeqs):
            self.engine.abort_request(msg.request_id, msg.indices)
            if msg.request_id not in self.engine.requests:
                self._forget(msg.request_id)
        elif isinstance(msg, UtilityCall):
            self._call(msg)

    def _add(self, msg: AddRequest) -> Ack:
        from kvpilot.runtime.sampling_params import SamplingParams

        try:
            if self.max_queue_len is not None and self.engine.num_waiting_requests >= self.max_queue_len:
                raise QueueFullError(
                    f"the server's queue is full ({self.max_queue_len} requests waiting); retry later")
            params = SamplingParams(**msg.params)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params,
                                    arrival_time=msg.arrival_time, priority=msg.priority,
                                    tenant=msg.tenant)
        except Exception as error:  # noqa: BLE001 - any failure goes back to the caller, never hangs it
            kind, message = error_kind(error)
            return Ack(msg.request_id, kind, message)
        self._sent[msg.request_id] = [0] * len(self.engine.requests[msg.request_id].seqs)
        if params.logprobs is not None:
            self._wants_logprobs.add(msg.request_id)
        if params.prompt_logprobs is not None:
            self._prompt_sent[msg.request_id] = 1
        return Ack(msg.request_id)

    def _call(self, msg: UtilityCall) -> None:
        fn = UTILITIES.get(msg.method)
        try:
            if fn is None:
                raise ValueError(f"unknown engine call {msg.method!r}")
            result = UtilityResult(msg.call_id, fn(self.engine, *msg.args))
        except Exception as error:  # noqa: BLE001 - handed back to the caller
            kind, message = error_kind(error)
            result = UtilityResult(msg.call_id, None, kind, message)
        self.send(result)

    def _forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._wants_logprobs.discard(request_id)
        self._prompt_sent.pop(request_id, None)

    # ---- outputs ---------------------------------------------------------------------------

    def _deltas(self, requests: list[Any]) -> list[RequestDelta]:
        """What the step added to each touched `Request` (sequence.py)."""
        deltas = []
        for request in requests:
            sent = self._sent.get(request.request_id)
            if sent is None:  # aborted meanwhile
                continue
            logprobs = request.request_id in self._wants_logprobs
            seqs = []
            for seq in request.seqs:
                start = sent[seq.index]
                if start is None:  # its end was reported
                    continue
                new = seq.token_ids[seq.num_prompt_tokens + start:]
                if not new and seq.finish_reason is None:
                    continue
                sent[seq.index] = None if seq.finish_reason is not None else start + len(new)
                lps = None
                if logprobs:
                    lps = [[(tid, lp.logprob, lp.rank) for tid, lp in entry.items()] for entry in seq.logprobs[start:]]
                stop = seq.stop_reason if isinstance(seq.stop_reason, int) else None
                seqs.append(SeqDelta(seq.index, new, lps, seq.finish_reason, stop))
            m = request.metrics
            finished = request.is_finished
            prompt_lps = None
            prompt_sent = self._prompt_sent.get(request.request_id)
            if prompt_sent is not None and len(request.prompt_logprobs) > prompt_sent:
                prompt_lps = [[(tid, lp.logprob, lp.rank) for tid, lp in entry.items()]
                              for entry in request.prompt_logprobs[prompt_sent:]]
                self._prompt_sent[request.request_id] = len(request.prompt_logprobs)
            deltas.append(RequestDelta(
                request.request_id, seqs, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                m.finished_time, max(seq.num_cached_tokens for seq in request.seqs), finished, prompt_lps))
            if finished:
                self._forget(request.request_id)
        return deltas

    def snapshot(self) -> EngineSnapshot:
        e = self.engine
        bm = e.block_manager
        cache, sched = e.config.cache, e.config.scheduler
        return EngineSnapshot(
            num_requests=e.num_unfinished_requests,
            num_waiting_requests=e.num_waiting_requests,
            num_running_seqs=len(e.scheduler.running),
            num_waiting_seqs=len(e.scheduler.waiting),
            num_swapped_seqs=len(e.scheduler.swapped),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            block_size=cache.block_size,
            preemption_mode=sched.preemption_mode,
            enable_prefix_caching=cache.enable_prefix_caching,
            waiting_requests_by_tenant=dict(e.scheduler.backlog),
            warming_up=bool(getattr(getattr(e, "warm_up", None), "pending", False)),
        )


def _as_is(request: Any) -> Any:
    return request


def _stats_msg(stats: Any) -> StepStatsMsg | None:
    if stats is None:
        return None
    return StepStatsMsg(stats.duration_s, stats.num_batched_tokens, stats.num_prompt_tokens,
                        stats.num_generation_tokens, stats.num_preemptions, stats.num_swapped_out,
                        stats.swap_out_bytes, stats.swap_in_bytes, stats.swap_out_seconds, stats.swap_in_seconds,
                        stats.served_tokens)
