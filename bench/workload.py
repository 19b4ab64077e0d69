"""The requests a benchmark sends: random token-id prompts of given or sampled lengths, or a local
JSONL dataset. No tokenizer is needed: random prompts are token ids, which `/v1/completions`
accepts on kvpilot and vLLM alike, so input lengths are exact whatever the server's model.

Random prompts follow vLLM's random dataset: lengths drawn uniformly from
[len * (1 - range_ratio), len * (1 + range_ratio)], an optional prefix shared by every prompt
(`prefix_len` tokens, what prefix caching can reuse), and ids drawn from `token_range` (the
default stays below 256, so any vocabulary holds them; special tokens of common vocabularies
lie at 0-16 or past 128,000).

Datasets, local files of two kinds:
* JSONL, one request a line: `{"prompt": "text"}` or `{"prompt_token_ids": [...]}`, optionally
  with `"output_len"` (or `"max_tokens"`); lines without one use the default.
* ShareGPT JSON (a list of `{"conversations": [{"from": ..., "value": ...}, ...]}`, the file vLLM's
  serving benchmark reads): as vLLM samples it, the conversations are shuffled by the seed, each
  gives its first turn as the prompt and the token count of the second (the reply) as the output
  length, and pairs with fewer than 4 tokens on either side, a prompt over 1,024 tokens or over
  2,048 together are passed over. Counting needs a tokenizer (the caller's `encode`).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_TOKEN_RANGE = (100, 256)
# vLLM's ShareGPT sampling limits, so both benchmarks draw the same requests from the file
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_LEN = 4, 1024, 2048


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


def load_dataset(path: Path, num_prompts: int, default_output_len: int, seed: int = 0,
                 encode: Callable[[str], list[int]] | None = None) -> list[BenchRequest]:
    """`num_prompts` requests from a JSONL file, in its order, or sampled from a ShareGPT JSON file
    (which needs `encode`, a tokenizer's); cycling when the file gives fewer."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"--dataset-path {path}: {getattr(e, 'strerror', None) or e}") from None
    if text.lstrip().startswith("["):
        entries = _sharegpt(path, text, num_prompts, seed, encode)
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        entries = [_entry(path, i + 1, line, default_output_len) for i, line in enumerate(lines)]
    if not entries:
        raise WorkloadError(f"--dataset-path {path}: the file holds no requests")
    return [entries[i % len(entries)] for i in range(num_prompts)]


def _sharegpt(path: Path, text: str, num_prompts: int, seed: int,
              encode: Callable[[str], list[int]] | None) -> list[BenchRequest]:
    where = f"--dataset-path {path}"
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{where}: not JSON: {e.msg} (line {e.lineno})") from None
    if not all(isinstance(entry, dict) and isinstance(entry.get("conversations"), list) for entry in body):
        raise WorkloadError(f"{where}: a JSON list, but not ShareGPT's: each entry needs a 'conversations' list "
                            f"(or give JSONL, one request a line)")
    if not body:
        return []
    if encode is None:
        raise WorkloadError(f"{where} is ShareGPT JSON: counting its replies' tokens (the output lengths) needs "
                            f"--tokenizer, a local tokenizer folder such as the model's")
    turns = [[t.get("value") if isinstance(t, dict) else None for t in entry["conversations"][:2]] for entry in body]
    pairs = [(first, reply) for first, reply in (t for t in turns if len(t) == 2)
             if isinstance(first, str) and isinstance(reply, str)]
    requests = []
    for i in np.random.default_rng(seed).permutation(len(pairs)).tolist():
        prompt, reply = pairs[i]
        prompt_len, output_len = len(encode(prompt)), len(encode(reply))
        if (min(prompt_len, output_len) < SHAREGPT_MIN_LEN or prompt_len > SHAREGPT_MAX_PROMPT_LEN
                or prompt_len + output_len > SHAREGPT_MAX_LEN):
            continue
        requests.append(BenchRequest(prompt, None, output_len))  # text: the server's usage counts it
        if len(requests) == num_prompts:
            break
    if pairs and not requests:
        raise WorkloadError(f"{where}: none of its {len(pairs)} conversations is within the sampling limits "
                            f"(>= {SHAREGPT_MIN_LEN} tokens each side, prompt <= {SHAREGPT_MAX_PROMPT_LEN}, "
                            f"prompt + reply <= {SHAREGPT_MAX_LEN})")
    return requests


def lazy_encoder(folder: str | None) -> Callable[[str], list[int]] | None:
    """A local tokenizer folder's `encode`, loaded on its first call (only a ShareGPT file calls it)."""
    if folder is None:
        return None

    @functools.cache
    def tokenizer() -> Any:
        from kvpilot.runtime import Tokenizer

        return Tokenizer(folder)
    return lambda text: tokenizer().encode(text)


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
