"""A step's postprocessing, in the engine core process (`LLM`: the caller's process): the tokens the
device sampled are appended to their sequences, detokenized and checked against the stop
conditions, and become the outputs of the requests they advanced.

`Launched` is a step queued on the device whose sampled tokens the host has not seen yet;
`Resolved`, what postprocessing one or more steps gave.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.runtime.engine import logprobs
from kvpilot.runtime.engine.isolation import Fail
from kvpilot.runtime.executor.inputs import StepInputs
from kvpilot.runtime.executor.sampler import DevicePromptLogprobs, DeviceSample, SampleResult
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.sched.scheduler import SchedulerOutput
from kvpilot.runtime.sched.sequence import Request, Sequence, check_stop
from kvpilot.runtime.tokenizer import Tokenizer


@dataclass
class Launched:
    """A step queued on the device whose sampled tokens the host has not seen yet."""

    sched: SchedulerOutput
    sampled: DeviceSample | None  # None: nothing sampled
    prompt: DevicePromptLogprobs | None = None  # prompt logprobs: the owners' rows, in order
    prompt_owners: list[tuple[Request, int]] = dataclasses.field(default_factory=list)


@dataclass
class Resolved:
    """What postprocessing one or more steps gave: their outputs and the tokens they delivered."""

    outputs: list[RequestOutput] = dataclasses.field(default_factory=list)
    num_prompt_tokens: int = 0  # prompts of the sequences that got their first token
    num_generation_tokens: int = 0

    def add(self, other: Resolved) -> None:
        self.outputs += other.outputs
        self.num_prompt_tokens += other.num_prompt_tokens
        self.num_generation_tokens += other.num_generation_tokens


def postprocess(launched: Launched, requests: dict[str, Request], *, tokenizer: Tokenizer | None,
                eos_token_ids: frozenset[int], max_model_len: int, finish: Callable[[Sequence], None],
                fail: Fail, make_output: Callable[[Request], RequestOutput],
                finished_only: bool = False) -> Resolved:
    """Append what the step sampled (waiting for it) to its sequences, detokenize (with a
    `tokenizer`) and apply stop conditions; the outputs of the requests touched (or finished),
    which leave `requests` when finished. A sequence that ended meanwhile (an earlier step's token,
    an abort) drops its token; one that ends now is passed to `finish`, and a request whose own
    values make this raise to `fail`."""
    # a token's text for logprob entries; none where the engine does not detokenize
    decode: logprobs.Decode = tokenizer.convert_id if tokenizer else logprobs.no_text
    result = launched.sampled.result() if launched.sampled is not None else SampleResult([], [])
    if launched.prompt is not None:
        logprobs.record_prompt(launched.prompt.result(), launched.prompt_owners,
                               lambda r: requests.get(r.request_id) is r, decode)
    now = time.time()
    touched: dict[str, Request] = {}
    token_ids, rows = result.token_ids, result.logprobs
    sample_index = num_prompt_tokens = num_generated = 0
    for s in launched.sched.scheduled:
        if not s.samples:
            continue
        seq = s.seq
        i = sample_index
        sample_index += 1
        if seq.is_finished:
            continue
        num_generated += 1
        token = token_ids[i]
        lp = rows[i]
        seq.num_pending_tokens -= 1
        seq.token_ids.append(token)
        if len(seq.token_ids) - seq.num_prompt_tokens == 1:
            num_prompt_tokens += seq.num_prompt_tokens
        try:  # what a request's own values can break fails that request alone
            if lp is not None:
                logprobs.record_sample(seq, token, lp, decode)
            new_text = tokenizer.detokenize_step(seq) if tokenizer is not None else ""
            check_stop(seq, token, len(new_text), eos_token_ids, max_model_len)
        except Exception as error:  # noqa: BLE001
            fail(seq.request, f"postprocessing failed: {type(error).__name__}: {error}")
            continue
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        if seq.finish_reason is not None:
            finish(seq)
        touched[seq.request.request_id] = seq.request
    outputs = []
    for request in touched.values():
        if request.error is not None:  # its output is out already
            continue
        if request.is_finished:
            request.metrics.finished_time = now
            requests.pop(request.request_id, None)
        elif finished_only:
            continue
        outputs.append(make_output(request))
    return Resolved(outputs, num_prompt_tokens, num_generated)


def reads_token_history(inputs: StepInputs) -> bool:
    """Whether sampling the step reads its sequences' tokens on the host (penalties, min_tokens),
    so every token of the step before must be known first."""
    for row in inputs.sampling_rows:
        p = row.params
        if p.needs_penalties or p.min_tokens:
            return True
    return False
