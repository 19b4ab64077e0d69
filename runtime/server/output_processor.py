"""The API process's half of the engine's postprocessing: token ids from the engine core in,
`RequestOutput`s out.

For each request the API process keeps its own `Request` (sequence.py, no torch) and appends the
core's new tokens to it; then, as `LLMEngine` does in one process, it detokenizes incrementally
(tokenizer.py), records logprobs, ends a sample at a stop string (cutting the text there) and
holds back a tail that may still become one. The core decides EOS, stop token ids and length; the
rules run in the engine's order (EOS and stop tokens before stop strings, stop strings before
length), so a served request ends exactly where `LLM.generate` ends it.
"""

from __future__ import annotations

import itertools
import time

from kvpilot.runtime.engine import logprobs
from kvpilot.runtime.engine.core import RequestDelta
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.sequence import (
    Request,
    Sequence,
    SequenceStatus,
    cut_stop_string,
    request_output,
)
from kvpilot.runtime.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()  # this process's mirror sequences (the core numbers its own)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float, priority: int = 0) -> Request:
        request = Request(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids, params=params,
                          arrival_time=arrival_time, priority=priority, seq_ids=self._seq_ids)
        self.requests[request_id] = request
        return request

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, delta: RequestDelta) -> tuple[RequestOutput | None, list[int]]:
        """Apply one request's new tokens; returns its output (None if unknown) and the indices of
        the samples this process ended at a stop string while the core still runs them."""
        request = self.requests.get(delta.request_id)
        if request is None:
            return None, []
        stopped: list[int] = []
        if delta.prompt_logprobs and request.prompt_logprobs is not None:
            decode = self._decode
            request.prompt_logprobs += [logprobs.from_message(triples, decode) for triples in delta.prompt_logprobs]
        for d in delta.seqs:
            seq = request.seqs[d.index]
            if seq.is_finished:  # ended here at a stop string; the core ran on meanwhile
                continue
            last = len(d.token_ids) - 1
            for j, token in enumerate(d.token_ids):
                seq.token_ids.append(token)
                if d.logprobs is not None:
                    self._record_logprobs(seq, d.logprobs[j])
                new_text = self.tokenizer.detokenize_step(seq) if self.tokenizer is not None else ""
                core_stop = j == last and d.finish_reason == "stop"  # EOS or a stop token: they come first
                p = seq.params
                if (not core_stop and p.stop_strings and new_text and seq.num_output_tokens >= p.min_tokens
                        and cut_stop_string(seq, len(new_text))):
                    if not (j == last and d.finish_reason is not None):
                        stopped.append(seq.index)
                    break
            if seq.finish_reason is None and d.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = d.finish_reason, d.stop_reason
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
        m = request.metrics
        if m.first_scheduled_time is None:
            m.first_scheduled_time = delta.first_scheduled_time
        if delta.first_token_time is not None and m.first_token_time is None:
            m.first_token_time = delta.first_token_time
        if delta.last_token_time is not None:
            m.last_token_time = delta.last_token_time
        for seq in request.seqs:
            seq.num_cached_tokens = delta.num_cached_tokens
        if request.is_finished:
            m.finished_time = delta.finished_time or time.time()
            del self.requests[request.request_id]
        return request_output(request), stopped

    def _record_logprobs(self, seq: Sequence, triples: list[tuple[int, float, int]]) -> None:
        seq.logprobs.append(logprobs.from_message(triples, self._decode))
        seq.cumulative_logprob += triples[0][1]

    @property
    def _decode(self) -> logprobs.Decode:
        return self.tokenizer.convert_id if self.tokenizer is not None else logprobs.no_text
