"""`LLMEngine`: requests in, outputs out, one step at a time.

A step is three visible calls: `scheduler.schedule()` decides which sequences advance and by how
many tokens, `runner.execute()` computes them and samples, `_postprocess()` appends tokens,
detokenizes, applies stop conditions and frees what finished.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch

from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.executor.model_runner import ModelRunner
from kvpilot.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from kvpilot.runtime.executor.parallel import destroy_group, start_tensor_parallel
from kvpilot.runtime.executor.sampler import SampleResult, SamplingRow
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.engine.scheduler import Scheduler, SchedulerOutput
from kvpilot.runtime.engine.sequence import Request, Sequence
from kvpilot.runtime.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# Engine settings that `update_config` changes on a live engine, and the config layer of each.
LIVE_TUNABLES = {
    "block_size": "cache", "preemption_mode": "scheduler", "scheduler_policy": "scheduler",
    "max_num_seqs": "scheduler", "max_num_batched_tokens": "scheduler",
}


class RequestError(ValueError):
    """A request the engine cannot take (bad prompt, too long, duplicate id)."""


@dataclass
class StepStats:
    """What one step did, for metrics and logs."""

    duration_s: float
    num_batched_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    num_swapped_out: int = 0  # of the preemptions, those swapped to host memory
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._workers: list[BaseProcess] = []
        tp = None
        if config.device.tensor_parallel_size > 1:
            self._workers, tp = start_tensor_parallel(config)
        self.runner = ModelRunner(config, tp)
        self.tokenizer = Tokenizer(config.model.tokenizer) if config.model.tokenizer else None
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.runner.num_swap_blocks)
        self.requests: dict[str, Request] = {}
        self._generators: dict[int, torch.Generator] = {}
        self.last_step: StepStats | None = None
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else set()
        # False in `kvpilot serve`'s engine core: the API process detokenizes and checks stop strings
        self.detokenize = True
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.runner.num_blocks,
                    config.cache.block_size, self.runner.num_blocks * self.runner.bytes_per_block / (1 << 30))

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any. The engine is unusable afterwards."""
        if self._workers:
            self.runner.stop_workers()
            for proc in self._workers:
                proc.join(timeout=30)
            self._workers = []
            destroy_group()

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> Request:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: pass prompt_token_ids instead of text")
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self._validate_prompt(token_ids)
        request = Request(request_id=request_id, prompt=text, prompt_token_ids=token_ids, params=params,
                          arrival_time=time.time() if arrival_time is None else arrival_time, priority=priority)
        for seq in request.seqs:
            if params.seed is not None:
                gen = torch.Generator(device=self.runner.device)
                gen.manual_seed(params.seed + seq.index)
                self._generators[seq.seq_id] = gen
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request

    def _validate_prompt(self, token_ids: list[int]) -> None:
        max_len = self.config.model.max_model_len
        vocab = self.runner.model_config.vocab_size
        if not token_ids:
            raise RequestError("the prompt is empty")
        if len(token_ids) >= max_len:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens; this model's maximum context length is {max_len} "
                "tokens, which must also leave room for at least one generated token")
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")

    def abort_request(self, request_id: str, indices: Collection[int] | None = None) -> None:
        """Stop a request now and free its blocks; unknown ids are ignored. With `indices`, only
        those samples stop (a stop string the API process found); the request ends with its last."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if indices is None or all(seq.is_finished or seq.index in indices for seq in request.seqs):
            del self.requests[request_id]
        for seq in request.seqs:
            if indices is not None and seq.index not in indices:
                continue
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
            self._generators.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- live tuning ----------------------------------------------------------------------

    def live_config(self) -> dict[str, object]:
        c = self.config
        return {"block_size": c.cache.block_size, "preemption_mode": c.scheduler.preemption_mode,
                "scheduler_policy": c.scheduler.policy, "max_num_seqs": c.scheduler.max_num_seqs,
                "max_num_batched_tokens": c.scheduler.max_num_batched_tokens}

    def update_config(self, changes: dict[str, object]) -> dict[str, object]:
        """Apply live tunables between steps without dropping a request; returns what changed
        as {name: {"old": ..., "new": ...}}. Call only from the thread that runs `step`.

        A new block size re-cuts the KV cache: running sequences are recompute-preempted first
        and re-prefilled on the next steps, so their outputs continue unchanged.
        """
        unknown = sorted(set(changes) - set(LIVE_TUNABLES))
        if unknown:
            raise ValueError(f"{unknown[0]}: not a live tunable (tunables: {', '.join(LIVE_TUNABLES)})")
        before = self.live_config()
        for name, value in changes.items():
            if type(value) is not type(before[name]):
                raise ValueError(f"{name}: expected {type(before[name]).__name__}, got {value!r}")
        wanted = {k: v for k, v in changes.items() if before[k] != v}
        sched_fields = {("policy" if k == "scheduler_policy" else k): v for k, v in wanted.items()
                        if LIVE_TUNABLES[k] == "scheduler"}
        cache = self.config.cache
        scheduler = dataclasses.replace(self.config.scheduler, **sched_fields)  # type: ignore[arg-type]
        if "block_size" in wanted:
            cache = dataclasses.replace(cache, block_size=wanted["block_size"])  # type: ignore[arg-type]
            self.scheduler.preempt_all()
            self.runner.resize_kv_cache(cache.block_size)
            self.block_manager = BlockManager(self.runner.num_blocks, cache.block_size,
                                              cache.enable_prefix_caching)
            self.scheduler.block_manager = self.block_manager
            self.scheduler.set_swap_space(self.runner.num_swap_blocks)
        self.config = dataclasses.replace(self.config, cache=cache, scheduler=scheduler)
        self.scheduler.config = scheduler
        after = self.live_config()
        return {k: {"old": before[k], "new": after[k]} for k in wanted}

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.swap_out or sched.swap_in:  # before the forward pass reuses the swapped-out blocks
            self.runner.swap_blocks(sched.swap_out, sched.swap_in)
        if sched.is_empty and not sched.preempted:
            self.last_step = None
            return []
        outputs: list[RequestOutput] = []
        rows = [self._sampling_row(s.seq) for s in sched.scheduled if s.samples]
        if not sched.is_empty:
            result = self.runner.execute(sched.scheduled, rows)
            outputs = self._postprocess(sched, result)
        first_tokens = [s.seq for s in sched.scheduled if s.samples and s.seq.num_output_tokens == 1]
        block_bytes = self.runner.bytes_per_block
        self.last_step = StepStats(
            duration_s=time.perf_counter() - start,
            num_batched_tokens=sched.num_batched_tokens,
            num_prompt_tokens=sum(seq.num_prompt_tokens for seq in first_tokens),
            num_generation_tokens=len(rows),
            num_preemptions=len(sched.preempted),
            num_swapped_out=sched.num_swapped_out,
            swap_out_bytes=len(sched.swap_out) * block_bytes,
            swap_in_bytes=len(sched.swap_in) * block_bytes,
        )
        return outputs

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        return SamplingRow(params=seq.params, token_ids=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
                           generator=self._generators.get(seq.seq_id), eos_token_ids=self.eos_token_ids)

    def _postprocess(self, sched: SchedulerOutput, result: SampleResult) -> list[RequestOutput]:
        now = time.time()
        touched: dict[str, Request] = {}
        sample_index = 0
        for s in sched.scheduled:
            seq = s.seq
            samples = s.samples
            seq.num_computed_tokens += s.num_new_tokens
            request = seq.request
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            if not samples:
                continue
            token = result.token_ids[sample_index]
            lp = result.logprobs[sample_index]
            sample_index += 1
            seq.token_ids.append(token)
            if lp is not None:
                self._record_logprobs(seq, token, lp)
            new_text = self.tokenizer.detokenize_step(seq) if self.detokenize and self.tokenizer else ""
            self._check_stop(seq, token, len(new_text))
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self._generators.pop(seq.seq_id, None)
            touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            finished = request.is_finished
            if finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
            outputs.append(self.make_output(request))
        return outputs

    def _record_logprobs(self, seq: Sequence, token: int, lp: tuple[float, int, list[tuple[int, float]]]) -> None:
        value, rank, top = lp
        decode = self.tokenizer.convert_id if self.detokenize and self.tokenizer else (lambda _t: None)
        entry = {token: Logprob(value, rank, decode(token))}
        for r, (tid, tlp) in enumerate(top, start=1):
            entry.setdefault(tid, Logprob(tlp, r, decode(tid)))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += value

    def _check_stop(self, seq: Sequence, token: int, num_new_chars: int) -> None:
        p = seq.params
        num_out = seq.num_output_tokens
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", None
                return
            if p.stop_token_ids and token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if p.stop_strings and num_new_chars and self._cut_stop_string(seq, num_new_chars):
                return
        max_len = self.config.model.max_model_len
        if (p.max_tokens is not None and num_out >= p.max_tokens) or seq.num_tokens >= max_len:
            seq.finish_reason = "length"

    @staticmethod
    def _cut_stop_string(seq: Sequence, num_new_chars: int) -> bool:
        """End the sequence at the first stop string in its text; the text is cut there."""
        p = seq.params
        longest = max(len(s) for s in p.stop_strings)
        # a new match must overlap the new characters: earlier text was checked in earlier steps
        window_start = max(0, len(seq.text) - num_new_chars - longest + 1)
        best: tuple[int, str] | None = None
        for stop in p.stop_strings:
            at = seq.text.find(stop, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        seq.text = seq.text[:at + len(stop)] if p.include_stop_str_in_output else seq.text[:at]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    @staticmethod
    def make_output(request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            text = seq.text
            p = seq.params
            if p.stop_strings and seq.finish_reason is None:
                # hold back a tail that may still become a stop string, so streamed text never
                # shows characters the final text will not have
                held = max(len(s) for s in p.stop_strings) - 1
                text = text[:max(0, len(text) - held)]
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if p.logprobs is not None else None,
                logprobs=seq.logprobs if p.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=completions,
                             finished=request.is_finished, metrics=request.metrics,
                             num_cached_tokens=max(seq.num_cached_tokens for seq in request.seqs))
