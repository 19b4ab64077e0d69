"""Requests and sequences, the scheduler's unit of work. No torch.

A *request* is what a user submitted (prompt + sampling params); it owns `n` *sequences*, one
per sample, each scheduled on its own. A sequence's tokens are its prompt followed by what it has
generated; `num_computed_tokens` of them have their keys and values in the KV cache, held in the
blocks listed in `block_table`. After a recompute preemption that count drops to zero and the
sequence is prefilled again, prompt and output alike.

Sequence ids are unique within one engine (each engine numbers its own: `seq_ids`), and
order sequences by creation.

With async scheduling (engine.py) a sequence's newest token may be *pending*: sampled by a step the
device still runs, counted in `num_tokens` (so the scheduler runs the sequence on), but not yet in
`token_ids`, which only ever holds known tokens. The next step's inputs take a pending token
straight from the device (`pending_sample`: its row in the latest step's samples).

A request that asks for prompt logprobs has them computed once, by its first sample's prefill
(`needs_prompt_logits`): that sample takes nothing from the prefix cache until every prompt
position has been scheduled, and positions scheduled once (before a recompute preemption, say)
are not scheduled again.

A request's *tenant* is whom it is served for (policies.py: the `fair` policy shares the engine
between tenants); requests that name none share `DEFAULT_TENANT`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import KW_ONLY, InitVar, dataclass, field

from kvpilot.runtime.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from kvpilot.runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


DEFAULT_TENANT = "default"


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    swap_table: list[int] = field(default_factory=list)  # host swap blocks while SWAPPED
    # prefix cache: digests of the leading full blocks already looked up or registered
    prefix_digests: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_prompt_tokens_served: int = 0  # prompt positions computed at least once (policies.py)
    # output side, filled by the engine's postprocessing
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # incremental detokenization state (see tokenizer.Detokenizer)
    prefix_offset: int = 0
    read_offset: int = 0
    # async scheduling: sampled tokens not yet on the host (0, or 1 between steps), the newest's
    # row in the latest launched step's samples, and whether it certainly ends the sequence
    # (max_tokens or max_model_len, known on the host: no step runs the sequence again)
    num_pending_tokens: int = 0
    pending_sample: int = -1
    ends_when_resolved: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        """Known and pending tokens: what the scheduler counts."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether later steps must compute logits at some of its prompt positions: the request
        asks for prompt logprobs, this is its first sample, and position `num_prompt_tokens - 2`
        (the last that predicts a prompt token) has not been scheduled yet."""
        request = self.request
        return (request.prompt_logprobs is not None and self.index == 0
                and request.prompt_logprob_cursor < self.num_prompt_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower runs first under the priority policy
    tenant: str = DEFAULT_TENANT
    seqs: list[Sequence] = field(init=False)
    metrics: RequestMetrics = field(init=False)
    # prompt logprobs asked: the entries so far (the first prompt token's is None), and the next
    # prompt position whose logits no step has been given yet
    prompt_logprobs: PromptLogprobs | None = field(init=False)
    prompt_logprob_cursor: int = field(init=False, default=0)
    error: str | None = field(init=False, default=None)  # set when the engine ends it alone on an error
    _: KW_ONLY
    seq_ids: InitVar[Iterator[int]]  # the engine's sequence numbering

    def __post_init__(self, seq_ids: Iterator[int]) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.prompt_logprobs = None if self.params.prompt_logprobs is None else [None]
        self.seqs = [
            Sequence(request=self, index=i, token_ids=list(self.prompt_token_ids),
                     num_prompt_tokens=len(self.prompt_token_ids), seq_id=next(seq_ids))
            for i in range(self.params.n)
        ]

    @property
    def is_finished(self) -> bool:
        for seq in self.seqs:  # read per request every step: a loop, not all() over a generator
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True


def check_stop(seq: Sequence, token: int, num_new_chars: int, eos_token_ids: frozenset[int],
               max_model_len: int) -> None:
    """Set the sequence's finish (and stop) reason if `token`, just appended, ends it: EOS, a stop
    token, a stop string in its `num_new_chars` new characters (cut there), or its length."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", None
            return
        if p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return
        if p.stop_strings and num_new_chars and cut_stop_string(seq, num_new_chars):
            return
    if reaches_length(seq, len(seq.token_ids), max_model_len):
        seq.finish_reason = "length"


def reaches_length(seq: Sequence, num_tokens: int, max_model_len: int) -> bool:
    """Whether `num_tokens` tokens end the sequence by length (max_tokens or the context)."""
    max_tokens = seq.params.max_tokens
    return (max_tokens is not None and num_tokens - seq.num_prompt_tokens >= max_tokens) or num_tokens >= max_model_len


def cut_stop_string(seq: Sequence, num_new_chars: int) -> bool:
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


def request_output(request: Request) -> RequestOutput:
    """The request's output so far: each sample's text and token ids from its start (a text that
    may still end in a stop string holds back that tail)."""
    p = request.params
    with_logprobs = p.logprobs is not None
    # hold back a tail that may still become a stop string, so streamed text never shows
    # characters the final text will not have
    held = max(len(s) for s in p.stop_strings) - 1 if p.stop_strings else 0
    completions = []
    num_cached_tokens = 0
    for seq in request.seqs:
        text = seq.text
        if held and seq.finish_reason is None:
            text = text[:max(0, len(text) - held)]
        # positional, in field order: keywords double the cost of a call made per request per step
        completions.append(CompletionOutput(
            seq.index, text, seq.token_ids[seq.num_prompt_tokens:],
            seq.cumulative_logprob if with_logprobs else None, seq.logprobs if with_logprobs else None,
            seq.finish_reason, seq.stop_reason))
        if seq.num_cached_tokens > num_cached_tokens:
            num_cached_tokens = seq.num_cached_tokens
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                         request.is_finished, request.metrics, num_cached_tokens, request.prompt_logprobs,
                         request.error)
