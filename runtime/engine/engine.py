"""`LLMEngine`: requests in, outputs out, one step at a time.

A step is three visible calls: `scheduler.schedule()` decides which sequences advance and by how
many tokens, `runner.launch()` computes them and samples, `_postprocess()` appends tokens,
detokenizes, applies stop conditions and frees what finished.

*Async scheduling* (`SchedulerConfig.async_scheduling`, on by default with CUDA) overlaps the
host's work with the device's: `step()` schedules step N+1 and queues it on the device while step N
still runs there, and only then waits for N's sampled tokens and postprocesses them, returning N's
outputs. A sequence that sampled in step N counts its token as *pending* (sequence.py) and runs
on in N+1, whose inputs take that token from N's samples on the device. What N's tokens decide
arrives one step late: a sequence that N ends (EOS, stop token or string) has also run in N+1, and
that token is dropped; one that N's token certainly ends (max_tokens, max_model_len: known on the
host) is not scheduled again. Frees stay safe without waiting, as the device runs the steps (and
the swap copies, swap.py) in the order they are queued. Where the host needs every token first,
the step in flight is *drained* (postprocessed before the next is queued): sampling with
penalties or min_tokens (they read the token history) and live config changes; its outputs come
out with the next `step()`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable, Collection
from typing import Concatenate, ParamSpec, TypeVar

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine import isolation
from kvpilot.runtime.engine.block_switch import (
    RelayoutReport,
    change_block_size,
    warm_up_block_switches,
)
from kvpilot.runtime.engine.postprocess import Launched, Resolved, postprocess, reads_token_history
from kvpilot.runtime.engine.step_stats import StepStats, step_stats
from kvpilot.runtime.engine.warm_up import WarmUp
from kvpilot.runtime.errors import RequestError
from kvpilot.runtime.executor.model_runner import ModelRunner
from kvpilot.runtime.executor.worker import Workers
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.block_manager import BlockManager
from kvpilot.runtime.sched.relayout import gc_paused
from kvpilot.runtime.sched.scheduler import Scheduler, SchedulerOutput
from kvpilot.runtime.sched.sequence import (
    DEFAULT_TENANT,
    Request,
    Sequence,
    reaches_length,
    request_output,
)
from kvpilot.runtime.startup import StartupLog
from kvpilot.runtime.tokenizer import Tokenizer, check_prompt, encode_prompt, eos_token_ids
from kvpilot.runtime.tunables import check_changes

logger = logging.getLogger(__name__)


P = ParamSpec("P")
R = TypeVar("R")


def _fails_with_workers(method: Callable[Concatenate[LLMEngine, P], R]) -> Callable[Concatenate[LLMEngine, P], R]:
    """An engine method that drives the tensor-parallel workers: once one has died it raises
    `WorkerDiedError` (an `EngineDeadError`) with the worker's error, now and on every later call."""
    @functools.wraps(method)
    def guarded(self: LLMEngine, *args: P.args, **kwargs: P.kwargs) -> R:
        workers = self._workers
        if workers is None:
            return method(self, *args, **kwargs)
        if workers.error is not None:
            raise workers.error
        try:
            return method(self, *args, **kwargs)
        except Exception as error:
            failure = workers.confirm(error)
            if failure is error:
                raise
            raise failure from error
    return guarded


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self._start_config = config
        self._config_view: EngineConfig | None = None
        self._workers: Workers | None = None
        # where start-up time goes (runtime/startup.py); `kvpilot serve` reports it at Ready
        self.startup = StartupLog("core")
        tp = None
        if config.device.tensor_parallel_size > 1:
            with self.startup.phase("tp_workers", count=config.device.tensor_parallel_size - 1):
                self._workers, tp = Workers.start(config)
        try:
            self.runner = ModelRunner(config, tp, self.startup)
        except BaseException as error:
            if self._workers is None:
                raise
            failure = self._workers.confirm(error)
            self._workers.shutdown()
            if failure is error:
                raise
            raise failure from error
        self._tokenizer: Tokenizer | None = None  # loaded on first use (`tokenizer`)
        with self.startup.phase("eos_token_ids"):
            eos = eos_token_ids(config.model.tokenizer) if config.model.tokenizer else set()
        layout = self.runner.layout  # the owner of the block size and the block counts
        self.block_manager = BlockManager(layout.num_blocks, layout.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, layout.num_swap_blocks)
        # what serving does not need yet: the swap space's host memory, other block sizes' kernels
        # and graphs, the switch pass
        self.warm_up = WarmUp(self.runner.prepare_later(),
                              lambda: warm_up_block_switches(self.scheduler, self.block_manager, self.runner),
                              idle_first=[("the swap space's host memory", self.runner.allocate_swap_host)])
        self.last_relayout: RelayoutReport | None = None
        self.requests: dict[str, Request] = {}
        self._unscheduled: set[str] = set()  # ids of the requests no step has scheduled yet
        self._seq_ids = itertools.count()  # this engine's own: ids key per-sequence state in the runner
        self._finished_seq_ids: list[int] = []  # for the runner to forget, with the next step
        self.last_step: StepStats | None = None
        self.eos_token_ids = frozenset(eos)
        # False in `kvpilot serve`'s engine core: the API process detokenizes and checks stop strings
        self.detokenize = True
        # resolved from the config; switching it between steps is safe (a step in flight is then
        # postprocessed by the next `step()`), which lets a benchmark compare both in one engine
        self.async_scheduling = config.async_scheduling
        self._in_flight: Launched | None = None  # async scheduling: the step the device runs
        self._drained = Resolved()  # a step postprocessed between steps: out with the next `step()`
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %s, %.2f GiB)", layout.num_blocks,
                    layout.block_size, layout.capacity_tokens, layout.dtype, layout.num_blocks * layout.bytes_per_block / (1 << 30))

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, loaded on first use: `kvpilot serve`'s engine core, which the API
        process sends token ids, never loads it (seconds saved before it is ready)."""
        if self._tokenizer is None and self.config.model.tokenizer:
            self._tokenizer = Tokenizer(self.config.model.tokenizer)
        return self._tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any. The engine is unusable afterwards."""
        if self._workers is not None:
            self._workers.shutdown(stop=self.runner.stop_workers)
            self._workers = None

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, tenant: str = DEFAULT_TENANT) -> Request:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        text, token_ids = encode_prompt(self.tokenizer if isinstance(prompt, str) else None, prompt)
        check_prompt(token_ids, self.vocab_size, self.config.model.max_model_len)
        params.check_vocab(self.vocab_size)
        request = Request(request_id=request_id, prompt=text, prompt_token_ids=token_ids, params=params,
                          arrival_time=time.time() if arrival_time is None else arrival_time, priority=priority,
                          tenant=tenant, seq_ids=self._seq_ids)
        for seq in request.seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = request
        self._unscheduled.add(request_id)
        return request

    @property
    def vocab_size(self) -> int:
        return int(self.runner.model_config.vocab_size)

    def abort_request(self, request_id: str, indices: Collection[int] | None = None) -> None:
        """Stop a request now and free its blocks; unknown ids are ignored. With `indices`, only
        those samples stop (a stop string the API process found); the request ends with its last."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if indices is None or all(seq.is_finished or seq.index in indices for seq in request.seqs):
            del self.requests[request_id]
            self._unscheduled.discard(request_id)
        for seq in request.seqs:
            if indices is not None and seq.index not in indices:
                continue
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)
            else:
                self._finished_seq_ids.append(seq.seq_id)

    def _finish(self, seq: Sequence) -> None:
        """End a sequence: its blocks are freed (a step in flight still writing them runs before any
        later step that reuses them) and a token it may still have pending is dropped."""
        self.scheduler.finish(seq)
        seq.num_pending_tokens = 0
        seq.ends_when_resolved = False
        self._finished_seq_ids.append(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        """Requests remain, or outputs that the next `step()` returns (a drained step's)."""
        return bool(self.requests) or bool(self._drained.outputs)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_waiting_requests(self) -> int:
        """Unfinished requests that no step has scheduled yet (kept as they change, not counted)."""
        return len(self._unscheduled)

    # ---- live tuning ----------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The configuration in force: the start's, with each live tunable read from its one
        holder — the block size from the runner's KV layout, the scheduling limits, policy and
        preemption mode from the scheduler's config — so no copy of them can go stale."""
        block_size, scheduler = self.runner.block_size, self.scheduler.config
        view = self._config_view
        if view is None or view.scheduler is not scheduler or view.cache.block_size != block_size:
            start = self._start_config
            view = self._config_view = dataclasses.replace(
                start, cache=dataclasses.replace(start.cache, block_size=block_size), scheduler=scheduler)
        return view

    def live_config(self) -> dict[str, object]:
        return self.config.tunables.to_json()

    @_fails_with_workers
    def update_config(self, changes: dict[str, object]) -> dict[str, object]:
        """Apply live tunables between steps without dropping a request; returns what changed
        as {name: {"old": ..., "new": ...}}. Call only from the thread that runs `step`. Every
        value is checked (the contract's rules, then the engine's own) before anything changes.

        A new block size re-cuts the KV cache in place and keeps the KV of running and swapped
        sequences (block_switch.py); `last_relayout` says what it cost. A higher max_num_seqs
        captures the decode graphs for the larger batch (on CUDA).
        """
        before = self.live_config()
        wanted = {k: v for k, v in check_changes(changes).items() if before[k] != v}
        if not wanted:
            return {}
        # the block size re-cuts the KV cache (block_switch.py); the others are the scheduler config's
        scheduler = dataclasses.replace(self.scheduler.config, **{  # type: ignore[arg-type]
            k: v for k, v in wanted.items() if k != "block_size"})
        limit = self.runner.profiled_step_tokens
        if limit is not None and scheduler.max_num_batched_tokens > limit:
            raise ValueError(f"max_num_batched_tokens: at most {limit} on this engine, the step its device memory "
                             f"was sized for at start (--max-num-batched-tokens); not {scheduler.max_num_batched_tokens}")
        self._drain()  # the changes (a re-cut above all) meet no token in flight
        if "block_size" in wanted:
            with gc_paused():
                self.last_relayout = change_block_size(self.scheduler, self.block_manager, self.runner,
                                                       int(wanted["block_size"]))  # type: ignore[call-overload]
        self.runner.fit_decode_graphs(scheduler.max_num_seqs)
        self.scheduler.reconfigure(scheduler)
        after = self.live_config()
        return {k: {"old": before[k], "new": after[k]} for k in wanted}

    # ---- the step -------------------------------------------------------------------------

    @_fails_with_workers
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; the output of each request it advanced (`finished_only`: of each request
        it finished, as `LLM.generate` needs, which saves building the others' every step). With
        async scheduling the outputs are those of the step before, which the device ran while this
        one was scheduled and queued."""
        start = time.perf_counter()
        sched = isolation.schedule(self.scheduler, self.requests.values(), self._fail_request)
        # every step, even without copies: the runner orders copies in flight by these calls
        self.runner.swap_blocks(sched.swap_out, sched.swap_in)
        done, self._drained = self._drained, Resolved()
        launched = self._launch(sched, done, finished_only) if not sched.is_empty else None
        done.add(self._postprocess_due(launched, finished_only))
        self.last_step = step_stats(sched, done, self.runner, start)
        return done.outputs

    def _launch(self, sched: SchedulerOutput, done: Resolved, finished_only: bool) -> Launched | None:
        """Queue the step on the device, then move the host's view on as if it had run: the
        scheduled tokens count as computed and each sampled token as pending, so the next step can
        be scheduled before this one's tokens are known. None if every request in it failed."""
        inputs = isolation.build_inputs(sched, self.runner.block_size, self.eos_token_ids, self._finished_seq_ids,
                                        self._fail_request)
        if inputs is None:
            return None
        if self._in_flight is not None and reads_token_history(inputs):
            # sampling reads the tokens so far: the step in flight is postprocessed first
            launched, self._in_flight = self._in_flight, None
            done.add(self._postprocess(launched, finished_only))
        queued = isolation.queue_on_device(self.runner, sched, inputs, self.eos_token_ids, self._finished_seq_ids,
                                           self._fail_request)
        if queued is None:
            return None
        (sampled, prompt), inputs = queued
        now = time.time()
        max_len = self._start_config.model.max_model_len  # not live: the start's, without the view
        sample_index = 0
        for s in sched.scheduled:
            seq = s.seq
            if seq.is_finished:  # ended by the step drained just before this one was queued
                sample_index += s.samples
                continue
            seq.num_computed_tokens += s.num_new_tokens
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                self._unscheduled.discard(seq.request.request_id)
            if s.samples:
                seq.num_pending_tokens += 1
                seq.pending_sample = sample_index
                sample_index += 1
                seq.ends_when_resolved = reaches_length(seq, seq.num_tokens, max_len)
        owners = [(self.requests[request_id], count) for request_id, count in inputs.prompt_logprob_owners]
        return Launched(sched, sampled, prompt, owners)

    def _postprocess_due(self, launched: Launched | None, finished_only: bool) -> Resolved:
        """Postprocess the steps whose tokens are due: the one in flight before this step (async
        scheduling: the device ran it while this one was prepared), and this one unless async
        scheduling leaves it in flight until the next `step()`."""
        done = Resolved()
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            done.add(self._postprocess(previous, finished_only))
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
            else:
                done.add(self._postprocess(launched, finished_only))
        return done

    def _fail_request(self, request: Request, message: str) -> None:
        """End `request` alone on an error raised by its own values; its output (finish reason
        "error", `error` set) comes out with the next `step()`, and the engine serves the rest."""
        logger.warning("request %s failed and was ended: %s", request.request_id, message)
        request.error = message
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "error"
                self._finish(seq)
        request.metrics.finished_time = time.time()
        if self.requests.pop(request.request_id, None) is not None:
            self._unscheduled.discard(request.request_id)
            self._drained.outputs.append(self.make_output(request))

    def _drain(self) -> None:
        """Postprocess the step in flight now (before a change that must meet no pending token);
        its outputs come out with the next `step()`."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._drained.add(self._postprocess(launched))

    def _postprocess(self, launched: Launched, finished_only: bool = False) -> Resolved:
        """`postprocess` the step (postprocess.py) against this engine's requests."""
        return postprocess(launched, self.requests, tokenizer=self.tokenizer if self.detokenize else None,
                           eos_token_ids=self.eos_token_ids, max_model_len=self._start_config.model.max_model_len,
                           finish=self._finish, fail=self._fail_request, make_output=self.make_output,
                           finished_only=finished_only)

    # the engine core replaces it on its engine (core.py): it reads the requests themselves
    make_output = staticmethod(request_output)

