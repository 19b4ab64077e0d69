"""`LLM`: the offline front door, shaped like vLLM's so users can switch."""

from __future__ import annotations

import itertools
from typing import Any

from kvpilot.runtime.args import EngineArgs
from kvpilot.runtime.engine.engine import LLMEngine
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.sampling_params import SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    """`LLM(model=None, **engine_args)`: `None` serves the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._start(EngineArgs.from_kwargs(model, engine_args))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An LLM from already-parsed arguments (the CLI's), without re-splitting them."""
        llm = cls.__new__(cls)
        llm._start(engine_args)
        return llm

    def _start(self, engine_args: EngineArgs) -> None:
        self.engine_args = engine_args
        self.engine = LLMEngine(engine_args.create_engine_config())
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release tensor-parallel workers; needed only with tensor_parallel_size > 1."""
        self.engine.shutdown()

    @property
    def tokenizer(self):  # noqa: ANN201 (transformers type)
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        batch = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"got {len(per_prompt)} sampling params for {len(batch)} prompts")
        ids = []
        try:
            for prompt, p in zip(batch, per_prompt, strict=True):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, _prompt_input(prompt), p)
                ids.append(request_id)
            return self._run(ids)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            self.engine.tokenizer.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                                                      chat_template=chat_template)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(done) < len(ids):
            for out in self.engine.step(finished_only=True):
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
        return [done[i] for i in ids]


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"])
    raise ValueError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [...]}")
