"""`SamplingParams`: how to pick each next token and when to stop, with vLLM's field names.

Every field is bounded here, so that no value a client can send reaches the sampler as something
it cannot represent (an int64 tensor, a generator seed) or loops over without end: integers fit
int64 (a seed leaves room for its `n` samples' `seed + i`), floats are finite, stop strings and
stop token ids are few and short. What depends on the model (token ids and `top_k` within its
vocabulary) is checked by `check_vocab`, which the server and the engine call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_STOP_STRINGS = 64  # stop strings per request; each is matched against every sample's new text
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows


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
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not INT64_MIN <= value <= INT64_MAX):
                raise ValueError(f"{name}: must be an integer within int64 (got {value!r})")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number (got {value!r})")
        stop_ids = self.stop_token_ids or []
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1, 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be between 0 and {MAX_LOGPROBS}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"must be between 0 and {MAX_LOGPROBS}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            # each sample i draws from a generator seeded with seed + i, which must fit int64
            (self.seed is None or self.seed <= INT64_MAX - (self.n - 1), "seed",
             f"must be at most 2**63 - n ({INT64_MAX - (self.n - 1)} with n = {self.n})"),
            (len(self.stop_strings) <= MAX_STOP_STRINGS, "stop", f"must hold at most {MAX_STOP_STRINGS} strings"),
            (all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop_strings), "stop",
             f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters"),
            (len(stop_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} ids"),
            (all(isinstance(t, int) and 0 <= t <= INT64_MAX for t in stop_ids), "stop_token_ids",
             "must be non-negative integers"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name}: {message} (got {_shown(getattr(self, name))})")

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError naming the field whose token ids or `top_k` exceed the model's vocabulary."""
        bad = [t for t in self.stop_token_ids or [] if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: must be token ids in [0, {vocab_size}) (got {_shown(bad)})")
        if self.top_k > vocab_size:
            raise ValueError(f"top_k: must be at most the vocabulary size, {vocab_size} (got {self.top_k})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _shown(value: object) -> str:
    """A value for an error message, cut short: an offending list may be long."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
