"""The engine core of `kvpilot serve`: the step loop in its own process.

The API process (HTTP, chat templates, tokenising, detokenising, streaming) and the core (schedule,
run, sample) share no GIL; they exchange the messages of messages.py. The core's busy loop, as
vLLM's: (1) take the commands that came (waiting for one while idle), (2) step the engine, (3) send
what the step produced.

The core runs `LLMEngine` with `detokenize = False`: the API process turns tokens into text and
ends a sample at a stop string (telling the core with `FinishSeqs`). A request that fails on its
own values ends alone (the engine's `RequestOutput.error`, sent as `RequestDelta.error`); a
command that cannot be read is dropped with a log line. The core exits when told to, when its step
loop raises (after sending `CoreDead` with the reason), or when the API process is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from kvpilot.runtime.engine.messages import (
    AbortRequests,
    Ack,
    AddRequests,
    CoreDead,
    CoreInput,
    CoreOutputs,
    EngineSnapshot,
    FinishSeqs,
    QueueFullError,
    Ready,
    RequestDelta,
    SeqDelta,
    Shutdown,
    StepStatsMsg,
    UtilityCall,
    UtilityResult,
    error_kind,
)
from kvpilot.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine is built in the core process only: its module imports torch
    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.engine.engine import LLMEngine
    from kvpilot.runtime.engine.step_stats import StepStats
    from kvpilot.runtime.engine.warm_up import WarmUp
    from kvpilot.runtime.sched.sequence import Request

logger = logging.getLogger(__name__)


def _live_config(engine: LLMEngine) -> dict[str, Any]:
    c = engine.config
    out = dict(engine.live_config())
    out.update(max_model_len=c.model.max_model_len, num_blocks=engine.block_manager.num_blocks)
    return out


def _update_config(engine: LLMEngine, changes: dict[str, Any]) -> dict[str, Any]:
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
    "update_config": _update_config,
    "device_memory": lambda engine: device_memory(engine.config.device.device),
}


def run_core(config: EngineConfig, input_addr: str, output_addr: str, max_queue_len: int | None,
             engine_factory: Callable[[EngineConfig], LLMEngine] | None = None,
             log_level: int = logging.INFO) -> None:
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
            if config.model.load_format != "dummy":
                # the disk reads the checkpoint while this process imports torch and builds the model
                from kvpilot.runtime.executor.checkpoint_files import read_ahead_folder

                read_ahead_folder(config.model.model)
            from kvpilot.runtime.engine.engine import LLMEngine

            engine_factory = LLMEngine
        from kvpilot.runtime.startup import starting_phase

        imports = starting_phase("core_imports", "core")
        engine = engine_factory(config)
        engine.detokenize = False
        # the step hands back its touched `Request`s as they are: the core reads only their new
        # tokens, instead of copying every sample's whole output into a `RequestOutput` each step
        engine.make_output = _as_is  # type: ignore[assignment]
        core = EngineCore(engine, max_queue_len, inbox, lambda msg: outbox.send(encoder.encode(msg)), parent)
        startup = getattr(engine, "startup", None)
        phases = [imports, *(startup.phases if startup is not None else [])]
        outbox.send(encoder.encode(Ready(core.snapshot(), os.getpid(), engine.vocab_size,
                                         [dataclasses.asdict(p) for p in phases])))
        core.run_busy_loop()
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
    """The busy loop around one engine: commands in, a step, outputs out; blocks while idle."""

    POLL_MS = 500  # while idle, how often to check that the API process still lives

    def __init__(self, engine: LLMEngine, max_queue_len: int | None, inbox: Any, send: Callable[[Any], Any],
                 parent_pid: int) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.inbox = inbox  # a zmq PULL socket
        self.send = send
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        # start-up work left for after Ready (warm_up.py): run while idle, and now and then between steps
        self.warm_up: WarmUp | None = getattr(engine, "warm_up", None)
        # request id -> per sample, the output tokens sent (None once its end was sent)
        self._sent: dict[str, list[int | None]] = {}
        self._wants_logprobs: set[str] = set()
        self._prompt_sent: dict[str, int] = {}  # prompt logprobs asked: entries sent (the first is None)

    def run_busy_loop(self) -> None:
        while not self._orphaned():
            # 1) poll the input queue: apply every command that came, waiting for one while idle
            if not self._process_input_queue():
                return
            # 2) step the engine core, 3) send what it produced
            if self.engine.has_unfinished_requests():
                self._step()

    def _orphaned(self) -> bool:
        if os.getppid() == self.parent_pid:
            return False
        logger.warning("the API process is gone: the engine core exits")
        return True

    def _process_input_queue(self) -> bool:
        """False once told to shut down or orphaned while waiting. While idle, the start-up work
        left for after Ready runs a unit at a time until a command comes."""
        if not self.engine.has_unfinished_requests():
            while not self.inbox.poll(0 if self._warming_up else self.POLL_MS):
                if self._warming_up:
                    self._warm_up_unit()
                elif self._orphaned():
                    return False
        acks: list[Ack] = []
        commands = 0
        for msg in self._commands():
            if isinstance(msg, Shutdown):
                return False
            commands += 1
            self._apply(msg, acks)
        if commands:
            self.send(CoreOutputs([], self.snapshot(), None, acks))
        return True

    def _commands(self) -> Iterator[Any]:
        """The commands that have come, decoded; one that cannot be is logged and dropped."""
        import zmq

        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                yield self.decoder.decode(raw)
            except msgspec.MsgspecError as error:
                logger.error("dropped a command the engine core cannot read: %s", error)

    @property
    def _warming_up(self) -> bool:
        return self.warm_up is not None and self.warm_up.pending

    def _warm_up_unit(self) -> None:
        assert self.warm_up is not None
        self.warm_up.run_one(idle=True)
        if not self.warm_up.pending:  # done: the API process learns it now, not at the next request
            self.send(CoreOutputs([], self.snapshot()))

    def _step(self) -> None:
        outputs = self.engine.step()
        stats = self.engine.last_step
        if self._warming_up:
            assert self.warm_up is not None
            self.warm_up.run_if_due(idle=False)
        if outputs or stats is not None:
            self.send(CoreOutputs(self._deltas(outputs), self.snapshot(), _stats_msg(stats)))
        else:
            time.sleep(0.001)  # nothing schedulable this instant; don't spin hot

    # ---- commands --------------------------------------------------------------------------

    def _apply(self, msg: Any, acks: list[Ack]) -> None:
        if isinstance(msg, AddRequests):
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

    def _add(self, msg: AddRequests) -> Ack:
        """Admit every request of `msg` or none: a refusal takes back those already added."""
        first = msg.requests[0].request_id
        added: list[str] = []
        try:
            waiting = self.engine.num_waiting_requests
            if self.max_queue_len is not None and waiting + len(msg.requests) > self.max_queue_len:
                raise QueueFullError(
                    f"the server's queue is full ({waiting} of {self.max_queue_len} requests waiting, "
                    f"{len(msg.requests)} more asked); retry later")
            for add in msg.requests:
                params = SamplingParams(**add.params)
                self.engine.add_request(add.request_id, add.prompt_token_ids, params, arrival_time=add.arrival_time,
                                        priority=add.priority, tenant=add.tenant)
                added.append(add.request_id)
        except Exception as error:  # noqa: BLE001 - any failure goes back to the caller, never hangs it
            for request_id in added:
                self.engine.abort_request(request_id)
            kind, message = error_kind(error)
            return Ack(first, kind, message)
        for request_id in added:
            request = self.engine.requests[request_id]
            self._sent[request_id] = [0] * len(request.seqs)
            if request.params.logprobs is not None:
                self._wants_logprobs.add(request_id)
            if request.params.prompt_logprobs is not None:
                self._prompt_sent[request_id] = 1
        return Ack(first)

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

    def _deltas(self, requests: list[Request]) -> list[RequestDelta]:
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
            if prompt_sent is not None and request.prompt_logprobs is not None \
                    and len(request.prompt_logprobs) > prompt_sent:
                prompt_lps = [[(tid, lp.logprob, lp.rank) for tid, lp in entry.items()]
                              for entry in request.prompt_logprobs[prompt_sent:] if entry is not None]
                self._prompt_sent[request.request_id] = len(request.prompt_logprobs)
            deltas.append(RequestDelta(
                request.request_id, seqs, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                m.finished_time, max(seq.num_cached_tokens for seq in request.seqs), finished, prompt_lps,
                request.error))
            if finished:
                self._forget(request.request_id)
        return deltas

    def snapshot(self) -> EngineSnapshot:
        e = self.engine
        bm = e.block_manager
        config = e.config
        return EngineSnapshot(
            num_requests=e.num_unfinished_requests,
            num_waiting_requests=e.num_waiting_requests,
            num_running_seqs=len(e.scheduler.running),
            num_waiting_seqs=len(e.scheduler.waiting),
            num_swapped_seqs=len(e.scheduler.swapped),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            waiting_requests_by_tenant=dict(e.scheduler.backlog),
            warming_up=self._warming_up,
            live=config.tunables,
        )


def _as_is(request: Request) -> Request:
    return request


def _stats_msg(stats: StepStats | None) -> StepStatsMsg | None:
    if stats is None:
        return None
    return StepStatsMsg(stats.duration_s, stats.num_batched_tokens, stats.num_prompt_tokens,
                        stats.num_generation_tokens, stats.num_preemptions, stats.num_swapped_out,
                        stats.swap_out_bytes, stats.swap_in_bytes, stats.swap_out_seconds, stats.swap_in_seconds,
                        stats.served_tokens)
