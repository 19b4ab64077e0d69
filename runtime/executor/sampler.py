"""Turning logits into tokens: penalties, temperature, top-k/top-p/min-p, seeded sampling, logprobs.

Rows are sequences that sample this step. Greedy rows take the argmax; random rows draw with the
exponential-race trick (argmax of p / E, E ~ Exp(1)), which equals sampling from p and lets each
seeded sequence draw its noise from its own generator, so its tokens do not depend on what else
is in the batch. Logprobs are those of the model's raw distribution (before penalties and
temperature), as vLLM reports them.

Prompt logprobs (`score_prompt`) score prompt positions instead: each row's logits against the
prompt token that follows it, with the same rank and top alternatives, over the rows in slices so
that a long prompt's logits never occupy more than `PROMPT_LOGITS_BYTES` at once.

Everything stays on the device until one copy brings the step's results to the host: the sampled
tokens and, for rows that asked, each one's logprob, rank and top alternatives, packed into one
float64 tensor (token ids are exact in float64). A filter's switches come from the host-side
parameters, never from a device value, and host lists reach the device through pinned memory
(batch.py's `to_device`), so no other synchronisation happens: the host can go on to prepare the
next step while this one runs (`sample_on_device`, `DeviceSample`).

`SeededSampler` is the runner's: it keeps each seeded sequence's generator, keyed by sequence id,
and names the rows whose own values make sampling fail (`RowsFailedError`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpilot.runtime.errors import RowsFailedError
from kvpilot.runtime.executor.batch import to_device
from kvpilot.runtime.executor.inputs import RowLogprobs, SamplingRow

PROMPT_LOGITS_BYTES = 1 << 28  # float32 logits of one slice of prompt rows


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (logprob of the sampled token, its rank, top-k [(token_id, logprob)]) or None
    logprobs: list[RowLogprobs | None]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.needs_penalties:
            continue
        output = row.token_ids[row.num_prompt_tokens:]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if output and (p.frequency_penalty or p.presence_penalty):
            ids = torch.tensor(output, dtype=torch.long, device=logits.device)
            counts = torch.zeros(vocab, device=logits.device).scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.float))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if len(row.token_ids) - row.num_prompt_tokens < p.min_tokens:
            banned = set(p.stop_token_ids or []) | (set() if p.ignore_eos else row.eos_token_ids)
            if banned:
                logits[i, list(banned)] = float("-inf")


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for random rows; returns probabilities."""
    device = logits.device
    temps = to_device([r.params.temperature for r in rows], torch.float32, device)
    logits = logits / temps[:, None]
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        k = to_device([k if k > 0 else vocab for k in top_k], torch.long, device)
        ranks = torch.arange(vocab, device=device)[None, :]
        remove = ranks >= k[:, None]
        probs_sorted = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        cum = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass strictly before each token
        remove |= cum >= to_device(top_p, torch.float32, device)[:, None]
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        min_p = to_device([r.params.min_p for r in rows], torch.float32, device)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           generators: list[torch.Generator | None] | None = None) -> SampleResult:
    """logits (num_rows, vocab), of any float dtype -> one token per row; `generators[i]` (None:
    the global one) draws row i's noise."""
    return sample_on_device(logits, rows, generators).result()


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow],
                     generators: list[torch.Generator | None] | None = None) -> DeviceSample:
    """`sample`, launched: the tokens stay on the device and their copy to the host is queued.
    `logits` may be in the model's dtype: greedy rows take their argmax there (widening to float32
    is exact, so it picks the same token), everything else is computed in float32."""
    device = logits.device
    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32) if any(want_logprobs) else None
    if any(r.params.needs_penalties or r.params.min_tokens for r in rows):
        logits = logits.to(torch.float32, copy=True)  # the caller's logits stay as they were
        _apply_penalties(logits, rows)
        _apply_min_tokens(logits, rows)
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        idx = to_device(random_rows, torch.long, device)
        probs = _filter(logits[idx].float(), [rows[i] for i in random_rows])
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            noise[j].exponential_(generator=generators[i] if generators else None)
        chosen[idx] = (probs / noise).argmax(dim=-1)
    if raw_logprobs is None:
        return DeviceSample(chosen, rows, [], 0, chosen)
    # rows with logprobs: the sampled token's logprob and rank, and the top-k of the widest ask
    wanted = [i for i, w in enumerate(want_logprobs) if w]
    idx = to_device(wanted, torch.long, device)
    k = max(rows[i].params.logprobs or 0 for i in wanted)
    packed = _pack_logprobs(raw_logprobs[idx], chosen[idx], k)
    return DeviceSample(chosen, rows, wanted, k, torch.cat([chosen.double(), packed.flatten()]))


def _pack_logprobs(lp: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of `lp` (float32 log-probabilities): `tokens`' logprob, its rank (1 = most likely),
    the top-k logprobs, then their token ids, as float64 (ids are exact there): (rows, 2 + 2k)."""
    token_lp = lp.gather(1, tokens[:, None])
    rank = (lp > token_lp).sum(dim=1, keepdim=True) + 1
    vals, ids = lp.topk(k, dim=1)
    return torch.cat([token_lp.double(), rank.double(), vals.double(), ids.double()], dim=1)


def _unpack_logprobs(values: list[float], k: int, want: int) -> RowLogprobs:
    """One row `_pack_logprobs` made, with the first `want` of its top k."""
    top = [(int(t), v) for t, v in zip(values[2 + k:2 + k + want], values[2:2 + want], strict=True)]
    return values[0], int(values[1]), top


class DeviceSample:
    """A step's sampled tokens on their way to the host. `token_ids` (num_rows,) stays on the
    device, where the next step's inputs can read it before the host has it (async scheduling);
    the step's one device-to-host copy is queued at once (into pinned memory, with an event on
    CUDA, so nothing waits for it) and `result()` waits for it and unpacks it."""

    def __init__(self, token_ids: torch.Tensor, rows: list[SamplingRow], wanted: list[int], k: int,
                 packed: torch.Tensor) -> None:
        self.token_ids = token_ids
        self._rows, self._wanted, self._k = rows, wanted, k
        self._host, self._ready = to_host(packed)

    def result(self) -> SampleResult:
        if self._ready is not None:
            self._ready.synchronize()
        rows, wanted, k, host = self._rows, self._wanted, self._k, self._host
        n = len(rows)
        logprobs: list[RowLogprobs | None] = [None] * n
        if not wanted:
            return SampleResult(token_ids=host.tolist(), logprobs=logprobs)
        token_ids = host[:n].long().tolist()
        for i, values in zip(wanted, host[n:].view(len(wanted), 2 + 2 * k).tolist(), strict=True):
            logprobs[i] = _unpack_logprobs(values, k, rows[i].params.logprobs or 0)
        return SampleResult(token_ids=token_ids, logprobs=logprobs)


def score_prompt(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                 targets: torch.Tensor, k: int, vocab_size: int, keep: bool = True) -> DevicePromptLogprobs | None:
    """Each row of `hidden` (prompt positions) scored against `targets` (the prompt token after
    each): its logprob under the model's raw distribution, its rank, and the top `k`, queued to the
    host like a sample. `keep=False` (tensor-parallel followers) only takes part in the logits'
    collectives."""
    step = max(1, PROMPT_LOGITS_BYTES // (4 * vocab_size))
    parts = []
    for begin in range(0, hidden.shape[0], step):
        logits = compute_logits(hidden[begin:begin + step])
        if not keep:
            continue
        lp = logits.log_softmax(dim=-1, dtype=torch.float32)
        parts.append(_pack_logprobs(lp, targets[begin:begin + step], k))
    return DevicePromptLogprobs(torch.cat(parts), k) if keep else None


class DevicePromptLogprobs:
    """A step's prompt logprobs on their way to the host (one queued copy, as `DeviceSample`)."""

    def __init__(self, packed: torch.Tensor, k: int) -> None:
        self._k = k
        self._host, self._ready = to_host(packed)

    def result(self) -> list[RowLogprobs]:
        """Per row: (the prompt token's logprob, its rank, the top k [(token id, logprob)])."""
        if self._ready is not None:
            self._ready.synchronize()
        return [_unpack_logprobs(values, self._k, self._k) for values in self._host.tolist()]


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """The step's one device-to-host copy, queued: the host tensor and the event that marks the
    copy done (None on the CPU, where `t` already is on the host)."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class SeededSampler:
    """Samples a step's rows on `device`, each seeded sequence drawing from its own generator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}  # seeded sequences' own random streams

    def forget(self, seq_ids: list[int]) -> None:
        """Drop the generators of sequences that finished."""
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> DeviceSample:
        """Sample every row; where that fails on the host (a row's values: a seed or top-k no
        generator or tensor holds), raise `RowsFailedError` naming the failing rows, found by
        trying each alone with a throwaway generator, so no other row's random stream moves.
        Device errors are not the request's: they propagate."""
        try:
            return sample_on_device(logits, rows, [self._generator(row) for row in rows])
        except Exception as error:
            if _is_device_error(error):
                raise
            failed: dict[int, str] = {}
            for i, row in enumerate(rows):
                try:
                    probe = None if row.seed is None else torch.Generator(device=self.device).manual_seed(row.seed)
                    sample_on_device(logits[i:i + 1], [row], [probe]).result()
                except Exception as row_error:
                    if _is_device_error(row_error):
                        raise
                    failed[row.seq_id] = f"{type(row_error).__name__}: {row_error}"
            if not failed:
                raise
            raise RowsFailedError(failed) from error

    def _generator(self, row: SamplingRow) -> torch.Generator | None:
        """A seeded sequence's generator, made on its first sample: its draws then depend only on
        its seed, not on what else runs in the batch."""
        if row.seed is None:
            return None
        gen = self._generators.get(row.seq_id)
        if gen is None:
            gen = self._generators[row.seq_id] = torch.Generator(device=self.device)
            gen.manual_seed(row.seed)
        return gen


def _is_device_error(error: BaseException) -> bool:
    """An error of the device itself (out of memory, a failed kernel), not of one row's values."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(error, torch.cuda.OutOfMemoryError | accelerator_error) or "CUDA" in str(error)
