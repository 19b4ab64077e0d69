"""`SamplingParams`: how to pick each next token and when to stop, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many top alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = ()
        elif isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        else:
            self.stop_strings = tuple(self.stop)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1, 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be between 0 and 20"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "must be between 0 and 20"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (all(isinstance(s, str) and s for s in self.stop_strings), "stop", "must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []), "stop_token_ids", "must be non-negative integers"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name}: {message} (got {getattr(self, name)!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
