"""The step plan: one step's index tensors, which every layer's ops take, and the index work the
CPU implementations derive from them once per step.

The model runner builds one `StepPlan` per forward pass (`Ops.plan`) and hands the same object
to the ops of every layer. The reference and CPU ops turn the index tensors into gather indices,
masks and rotary rows; each of those is computed by the first layer that needs it and kept on
the plan (`functools.cached_property`) for the others: on a 2-core CPU each small torch op costs
several microseconds, and recomputing them per layer made the engine's CPU step spend about as
long in such ops as in attention itself. The Triton ops read the tensors only. A plan's tensors
must not change while it is in use; the next step builds a new plan.

Layouts (the contract of `reference.py`):
  positions       (num_tokens,) int64      context position of each new token
  slot_mapping    (num_tokens,) int64      flat cache slot (block_id * block_size + offset); -1 = skip
  block_tables    (num_seqs, max_blocks) int32
  seq_lens        (num_seqs,) int32        context length, new tokens included
  query_start_loc (num_seqs + 1,) int32    sequence i owns rows qsl[i]:qsl[i+1] of the step
  cos_sin_cache   (max_position, head_dim) float32, cos in [:, :head_dim/2], sin in the rest
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Protocol

import torch


class AttentionInputs(Protocol):
    """The attention metadata of a step as the model runner builds it."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int


class WriteIndex(NamedTuple):
    rows: torch.Tensor | None  # rows of k/v with a slot; None when every row has one
    blocks: torch.Tensor  # their cache blocks
    offsets: torch.Tensor  # and slots within the block


class DecodeIndex(NamedTuple):
    rows: torch.Tensor | None  # q rows of the decode sequences; None when the batch is all decode
    table: torch.Tensor  # (num_decode * nb,) int64 block ids, nb blocks per sequence
    num_seqs: int
    max_len: int
    mask: torch.Tensor  # (num_decode, 1, 1, max_len) bool: key position < context length


class PrefillIndex(NamedTuple):
    start: int  # q rows start:end
    end: int
    table: torch.Tensor  # int64 block ids covering the context
    length: int
    mask: torch.Tensor | None  # (q_len, length) bool causal mask; None: plain causal (no cached context)


class AttentionIndex(NamedTuple):
    decode: DecodeIndex | None  # the sequences with one new token, batched
    prefill: list[PrefillIndex]  # the others, one by one


class DecodeRows(NamedTuple):
    seq_ids: torch.Tensor  # int32: the decode sequences (q_len == 1)
    q_rows: torch.Tensor  # int64: their query rows
    all_decode: bool


class RotaryRows(NamedTuple):
    cos: torch.Tensor  # (num_tokens, 1, head_dim): cos of each token's position, both halves
    sin: torch.Tensor


def plan_write(slot_mapping: torch.Tensor, block_size: int) -> WriteIndex:
    valid = slot_mapping >= 0
    rows = None if bool(valid.all()) else valid.nonzero().squeeze(1)
    slots = slot_mapping if rows is None else slot_mapping[rows]
    return WriteIndex(rows, slots // block_size, slots % block_size)


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   block_size: int, num_tokens: int) -> AttentionIndex:
    device = block_tables.device
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    decode_index = None
    if decode:
        all_decode = len(decode) == len(lens) == num_tokens
        ctx = [lens[i] for i in decode]
        max_len = max(ctx)
        nb = -(-max_len // block_size)
        table = (block_tables if all_decode else block_tables[decode])[:, :nb].long().flatten()
        mask = torch.arange(max_len, device=device)[None, :] < torch.tensor(ctx, device=device)[:, None]
        rows = None if all_decode else torch.tensor([starts[i] for i in decode], device=device)
        decode_index = DecodeIndex(rows, table, len(decode), max_len, mask[:, None, None, :])
    prefill = []
    for i, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        length = lens[i]
        # query row r sits at context position length - q_len + r and sees keys 0..that position
        causal: torch.Tensor | None = None  # None: no cached context, SDPA's own causal path
        if length != q_len:
            pos = torch.arange(length - q_len, length, device=device)
            causal = torch.arange(length, device=device)[None, :] <= pos[:, None]
        table = block_tables[i, :-(-length // block_size)].long()
        prefill.append(PrefillIndex(starts[i], starts[i + 1], table, length, causal))
    return AttentionIndex(decode_index, prefill)


def plan_decode_rows(query_start_loc: torch.Tensor) -> DecodeRows:
    starts = query_start_loc.tolist()
    seqs = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
    return DecodeRows(torch.tensor(seqs, dtype=torch.int32), torch.tensor([starts[i] for i in seqs], dtype=torch.int64),
                      len(seqs) == len(starts) - 1)


def plan_rotary(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> RotaryRows:
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return RotaryRows(torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))


@dataclass(frozen=True, eq=False)
class StepPlan:
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int  # the most new tokens of any sequence (1: a decode-only step)
    cos_sin_cache: torch.Tensor
    block_size: int  # the caches' (their dim 1)

    def check_block_size(self, k_cache: torch.Tensor) -> None:
        """The derived indices hold block ids and offsets for `block_size`: a cache of another
        block size would be read at the wrong slots."""
        if k_cache.shape[1] != self.block_size:
            raise ValueError(f"the step was planned for block_size {self.block_size}, "
                             f"but the cache has {k_cache.shape[1]}-token blocks")

    @cached_property
    def write(self) -> WriteIndex:
        return plan_write(self.slot_mapping, self.block_size)

    @cached_property
    def attention(self) -> AttentionIndex:
        return plan_attention(self.block_tables, self.seq_lens, self.query_start_loc, self.block_size,
                              self.positions.shape[0])

    @cached_property
    def decode_rows(self) -> DecodeRows:
        return plan_decode_rows(self.query_start_loc)

    @cached_property
    def rotary(self) -> RotaryRows:
        return plan_rotary(self.positions, self.cos_sin_cache)
