"""OpenAI request bodies (pydantic, the HTTP edge only) and their conversion to `SamplingParams`.

Fields follow OpenAI's API plus vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, ...). Unknown fields are ignored, as OpenAI clients send `extra_body`
freely; wrong types are rejected (the server turns pydantic's errors into a 400), and so are
numbers that are not finite (`NaN`, `Infinity`) and names longer than `MAX_NAME_CHARS`. OpenAI fields
that change what a client gets back and that this server cannot honour (tool calls, a JSON
response format, `logit_bias`, `suffix`, `prompt_logprobs` on chat) are refused with a 400
naming the field, never ignored: a client relying on them would otherwise take plain text for
their result.

Completions take `echo` (the prompt before the completion, and with `logprobs` the prompt's
logprobs too, the first token's null: what log-likelihood evaluations send, often with
`max_tokens: 0`, which echo alone allows) and vLLM's `prompt_logprobs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from kvpilot.runtime.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

MAX_NAME_CHARS = 256  # `model`, `user`: names, echoed in errors and metric labels
MAX_CHAT_TEMPLATE_CHARS = 1 << 17  # a request's own chat template (--trust-request-chat-template)
# prompts in one completions request, also when --max-queue-len is unset: each is an engine request,
# admitted together, so the list is refused before its items are even validated
MAX_PROMPTS = 1024


class APIError(Exception):
    """An error a client can cause, answered as OpenAI's error JSON with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # e.g. a 429's Retry-After

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by chat and completions requests."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    # vLLM's extra sampling fields
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's scheduling extra: lower runs first under --scheduler-policy priority (ignored otherwise)
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    logit_bias: dict[str, float] | None = None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError naming the field for values out of range."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias: is not supported by this server")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as a chat template expects it: content parts flattened to one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("messages: only text content parts are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        if content is None and self.role != "assistant":
            raise ValueError(f"messages: a {self.role} message needs content; null content is only allowed "
                             "in assistant messages")
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = Field(default=None, max_length=MAX_CHAT_TEMPLATE_CHARS)
    # refused unless they ask for nothing this server cannot do (no tool-call parser, no guided decoding)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    prompt_logprobs: int | None = None  # vLLM's; served by /v1/completions only

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: is not supported on chat completions; send the templated "
                             "prompt to /v1/completions with prompt_logprobs (or echo and logprobs)")
        for field, choice in (("tools", self.tool_choice), ("functions", self.function_call)):
            if getattr(self, field) and choice != "none":
                raise ValueError(f"{field}: tool calling is not supported by this server (it parses no tool calls "
                                 f"from the output); leave {field} out")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"response_format: type {kind!r} is not supported by this server (no guided "
                             f"decoding); only 'text'")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many alternatives
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _at_most_max_prompts(cls, prompt: Any) -> Any:
        # a list of token ids is one prompt (the context bounds it); a list of anything else is prompts
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
            raise PydanticCustomError("too_many_prompts", "{count} prompts in one request; at most {limit}",
                                      {"count": len(prompt), "limit": MAX_PROMPTS})
        return prompt

    @property
    def prompt_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) back, nothing generated."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix: is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: is not supported (must equal n)")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be at least 1 (0 only with echo, which returns the prompt)")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs: must be between 0 and 20 (got {self.prompt_logprobs})")
        asks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        # the engine generates one token for max_tokens 0, which the response leaves out
        max_tokens = 1 if self.prompt_only else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, max(asks) if asks else None)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each a string or a list of token ids: OpenAI's `prompt` is
        one of these or a list of them."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt: must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if any(not x for x in p):
            raise ValueError("prompt: must not hold an empty prompt")
        return list(p)  # type: ignore[arg-type]
