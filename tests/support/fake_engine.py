"""A stand-in for `LLMEngine` that the engine core can build in its process (tests of the async
front): each request emits one token per step and finishes after NUM_TOKENS. The prompt decides
the behaviour, since the fake lives in another process: "crash" makes the next step raise,
"explode" fails admission with a non-ValueError, "hold" keeps the request waiting unscheduled,
"fail" ends the request alone with an error (as `LLMEngine` ends one whose sampling raised), and
"die" kills the core's process outright."""

from __future__ import annotations

import itertools
import os
import signal
from types import SimpleNamespace
from typing import Any

from kvpilot.runtime.errors import RequestError
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.sequence import DEFAULT_TENANT, Request, SequenceStatus
from kvpilot.runtime.tunables import LiveConfig

NUM_TOKENS = 3
TOKENS = {"hi": 1, "crash": 2, "explode": 3, "hold": 4, "die": 5, "fail": 6}


class FakeEngine:
    def __init__(self, config: Any = None) -> None:
        self.requests: dict[str, Any] = {}
        self.scheduler = SimpleNamespace(running=[], waiting=[], swapped=[], backlog={})
        self.block_manager = SimpleNamespace(num_free_blocks=8, num_blocks=8, usage=0.0)
        self.config = SimpleNamespace(
            cache=SimpleNamespace(block_size=16, enable_prefix_caching=False),
            scheduler=SimpleNamespace(preemption_mode="recompute"),
            model=SimpleNamespace(max_model_len=64), device=SimpleNamespace(device="cpu"),
            tunables=LiveConfig(block_size=16, preemption_mode="recompute", max_num_seqs=8,
                                max_num_batched_tokens=2048))
        self.last_step = None
        self.vocab_size = 32
        self.num_steps = 0
        self.aborted: list[str] = []
        self._seq_ids = itertools.count()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_waiting_requests(self) -> int:
        return sum(1 for r in self.requests.values() if r.metrics.first_scheduled_time is None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def live_config(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "aborted": self.aborted}

    def update_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        raise ValueError("block_size: not here")

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, tenant: str = DEFAULT_TENANT) -> None:
        if prompt == [TOKENS["explode"]]:
            raise KeyError("not a ValueError")
        if not prompt:
            raise RequestError("the prompt is empty")
        self.requests[request_id] = Request(request_id, None, list(prompt), params, arrival_time or 0.0, priority,
                                           tenant=tenant, seq_ids=self._seq_ids)
        self.block_manager.num_free_blocks -= 1

    def abort_request(self, request_id: str, indices: Any = None) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)
            self.block_manager.num_free_blocks += 1

    def step(self) -> list[RequestOutput]:
        """Returns what `LLMEngine.step` returns with `make_output` replaced, as the core does."""
        self.num_steps += 1
        outputs = []
        for request_id, r in list(self.requests.items()):
            if r.prompt_token_ids == [TOKENS["crash"]]:
                raise RuntimeError("boom")
            if r.prompt_token_ids == [TOKENS["die"]]:
                os.kill(os.getpid(), signal.SIGKILL)
            if r.prompt_token_ids == [TOKENS["hold"]]:
                continue
            if r.prompt_token_ids == [TOKENS["fail"]]:
                r.error = "RuntimeError: sampling this request failed"
                r.seqs[0].finish_reason, r.seqs[0].status = "error", SequenceStatus.FINISHED
                del self.requests[request_id]
                self.block_manager.num_free_blocks += 1
                outputs.append(self.make_output(r))
                continue
            r.metrics.first_scheduled_time = 1.0
            seq = r.seqs[0]
            seq.token_ids.append(10 + seq.num_output_tokens)
            if seq.num_output_tokens == NUM_TOKENS:
                seq.finish_reason, seq.status = "length", SequenceStatus.FINISHED
                del self.requests[request_id]
                self.block_manager.num_free_blocks += 1
            outputs.append(self.make_output(r))
        return outputs

    @staticmethod
    def make_output(request: Request) -> RequestOutput:
        raise AssertionError("the core replaces make_output")
