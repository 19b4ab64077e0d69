"""The requests a benchmark sends: random token-id prompts of given or sampled lengths, or a local
JSONL dataset. No tokenizer is needed: random prompts are token ids, which `/v1/completions`
accepts on kvpilot and vLLM alike, so input lengths are exact whatever the server's model.

Random prompts follow vLLM's random dataset: lengths drawn uniformly from
[len * (1 - range_ratio), len * (1 + range_ratio)], an optional prefix shared by every prompt
(`prefix_len` tokens, what prefix caching can reuse), and ids drawn from `token_range` (the
default stays below 256, so any vocabulary holds them; special tokens of common vocabularies
lie at 0-16 or past 128,000).

Dataset lines (JSONL), one request each: `{"prompt": "text"}` or `{"prompt_token_ids": [...]}`,
optionally with `"output_len"` (or `"max_tokens"`); lines without one use the default.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_TOKEN_RANGE = (100, 256)


class WorkloadError(ValueError):
    """Bad workload input; the message names the flag, file or line."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int | None  # None for text prompts: the server's usage tells
    output_len: int


@dataclass(frozen=True)
class RandomSpec:
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise WorkloadError(f"num_prompts: must be >= 1, not {self.num_prompts}")
        for name in ("input_len", "output_len"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name}: must be >= 1, not {getattr(self, name)}")
        if not 0 <= self.range_ratio < 1:
            raise WorkloadError(f"range_ratio: must lie in [0, 1), not {self.range_ratio}")
        if self.prefix_len < 0:
            raise WorkloadError(f"prefix_len: must be >= 0, not {self.prefix_len}")
        low, high = self.token_range
        if not 0 <= low < high:
            raise WorkloadError(f"token_range: must be LOW < HIGH, both >= 0, not {low}:{high}")


def sampled_lengths(rng: np.random.Generator, count: int, mean: int, range_ratio: float) -> np.ndarray:
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count)


def random_requests(spec: RandomSpec, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    low, high = spec.token_range
    prefix = rng.integers(low, high, size=spec.prefix_len).tolist()
    inputs = sampled_lengths(rng, spec.num_prompts, spec.input_len, spec.range_ratio)
    outputs = sampled_lengths(rng, spec.num_prompts, spec.output_len, spec.range_ratio)
    requests = []
    for n_in, n_out in zip(inputs.tolist(), outputs.tolist(), strict=True):
        ids = prefix + rng.integers(low, high, size=n_in).tolist()
        requests.append(BenchRequest(ids, len(ids), n_out))
    return requests


def load_dataset(path: Path, num_prompts: int, default_output_len: int, seed: int = 0) -> list[BenchRequest]:
    """`num_prompts` requests from the file, in its order, cycling when it holds fewer."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise WorkloadError(f"--dataset-path {path}: {e.strerror}") from None
    if not lines:
        raise WorkloadError(f"--dataset-path {path}: the file holds no requests")
    entries = [_entry(path, i + 1, line, default_output_len) for i, line in enumerate(lines)]
    return [entries[i % len(entries)] for i in range(num_prompts)]


def _entry(path: Path, line_no: int, line: str, default_output_len: int) -> BenchRequest:
    where = f"--dataset-path {path}, line {line_no}"
    try:
        body = json.loads(line)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{where}: not JSON: {e.msg}") from None
    if not isinstance(body, dict):
        raise WorkloadError(f"{where}: expected an object with 'prompt' or 'prompt_token_ids'")
    output_len = body.get("output_len", body.get("max_tokens", default_output_len))
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise WorkloadError(f"{where}: output_len must be a positive integer, not {output_len!r}")
    if "prompt_token_ids" in body:
        ids = body["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise WorkloadError(f"{where}: prompt_token_ids must be a non-empty list of token ids")
        return BenchRequest(ids, len(ids), output_len)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise WorkloadError(f"{where}: expected a non-empty 'prompt' string or 'prompt_token_ids'")
    return BenchRequest(prompt, None, output_len)
