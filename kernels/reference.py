"""Plain-torch reference ops: the CPU path of the engine and the specification the Triton
kernels are tested against.

Layouts (shared with `kvpilot.kernels.triton_ops`; `ops.py` documents the contract):
  q, out        (num_tokens, num_heads, head_dim)            varlen batch, sequences back to back
  k_cache/v_cache (num_blocks, block_size, num_kv_heads, head_dim)
  block_tables  (num_seqs, max_blocks) int32                  block ids of each sequence, in order
  seq_lens      (num_seqs,) int32      context length per sequence, new tokens included
  query_start_loc (num_seqs + 1,) int32 cumulative query lengths; sequence i owns rows
                qsl[i]:qsl[i+1] of q, which are its last (qsl[i+1]-qsl[i]) context positions
  slot_mapping  (num_tokens,) int64    flat slot (block_id * block_size + offset); -1 = skip
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


class StepMemo:
    """One derived value (index tensors, masks) remembered for the tensors it came from.

    The model calls each op once per layer with the same per-step tensors, so index work done once
    serves every layer: on the 2-core CPU each small torch op costs several microseconds, and the
    engine's CPU step was spending about as long in such ops as in attention itself. The memo holds
    its key tensors (so their ids cannot be reused while remembered) and, for ordinary tensors,
    their version counters (so an in-place change is noticed). Tensors made under
    `torch.inference_mode` (the engine's) have no version counter: per the op contract (ops.py),
    callers pass new index tensors for new contents instead of changing them in place.
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] = ()
        self._versions: tuple[int, ...] = ()
        self._value: Any = None

    def get(self, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        tensors = [k for k in key if isinstance(k, torch.Tensor)]
        versions = tuple(-1 if t.is_inference() else t._version for t in tensors)
        same = (len(key) == len(self._key) and versions == self._versions
                and all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(key, self._key, strict=True)))
        if not same:
            self._value = build()
            self._key, self._versions = key, versions
        return self._value


_write_plan = StepMemo()
_attention_plan = StepMemo()
_rotary_plan = StepMemo()


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' keys and values into their cache slots, in place."""
    block_size = k_cache.shape[1]

    def plan() -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        valid = slot_mapping >= 0
        rows = None if bool(valid.all()) else valid.nonzero().squeeze(1)
        slots = slot_mapping if rows is None else slot_mapping[rows]
        return rows, slots // block_size, slots % block_size

    rows, blocks, offsets = _write_plan.get((slot_mapping, block_size), plan)
    # (block, offset) indexing works for any physical layout (see `kv_cache_empty`)
    k_cache[blocks, offsets] = k if rows is None else k[rows]
    v_cache[blocks, offsets] = v if rows is None else v[rows]


def kv_cache_empty(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                   head_major: bool, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed cache of the contract's shape (num_blocks, block_size, num_kv_heads, head_dim).

    head_major stores it as (num_blocks, num_kv_heads, block_size, head_dim) and returns the
    transposed view: each (block, KV head) is then one contiguous run of block_size * head_dim
    elements instead of block_size rows of head_dim scattered num_kv_heads rows apart. Every op
    takes either (they use strides); the GPU engine allocates head-major (benchmarks/RESULTS.md).
    """
    if not head_major:
        return torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device).transpose(1, 2)


class _DecodePlan(NamedTuple):
    rows: torch.Tensor | None  # q rows of the decode sequences; None when the batch is all decode
    table: torch.Tensor  # (num_decode * nb,) int64 block ids, nb blocks per sequence
    num_seqs: int
    max_len: int
    mask: torch.Tensor  # (num_decode, 1, 1, max_len) bool: key position < context length


class _PrefillPlan(NamedTuple):
    start: int  # q rows start:end
    end: int
    table: torch.Tensor  # int64 block ids covering the context
    length: int
    mask: torch.Tensor | None  # (q_len, length) bool causal mask; None: plain causal (no cached context)


def _plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    block_size: int, num_tokens: int) -> tuple[_DecodePlan | None, list[_PrefillPlan]]:
    device = block_tables.device
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    decode_plan = None
    if decode:
        all_decode = len(decode) == len(lens) == num_tokens
        ctx = [lens[i] for i in decode]
        max_len = max(ctx)
        nb = -(-max_len // block_size)
        table = (block_tables if all_decode else block_tables[decode])[:, :nb].long().flatten()
        mask = torch.arange(max_len, device=device)[None, :] < torch.tensor(ctx, device=device)[:, None]
        rows = None if all_decode else torch.tensor([starts[i] for i in decode], device=device)
        decode_plan = _DecodePlan(rows, table, len(decode), max_len, mask[:, None, None, :])
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
        prefill.append(_PrefillPlan(starts[i], starts[i + 1], table, length, causal))
    return decode_plan, prefill


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.
    `max_query_len` is the Triton launcher's hint (see `paged_attention.py`); the plan here reads
    the lengths from the index tensors anyway, so it is not needed.

    Decode sequences (one new token) are batched into one padded call; sequences with several
    new tokens (prefill, chunked prefill) are computed one by one. The index work is planned once
    per step and shared by every layer (`StepMemo`).
    """
    decode, prefill = _plan_for(q, k_cache, block_tables, seq_lens, query_start_loc)
    out = torch.empty_like(q)
    if decode is not None:
        num_seqs, num_heads, head_dim = decode.num_seqs, q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        # index_select on the block dim: one contiguous copy of each sequence's blocks
        shape = (num_seqs, -1, num_kv_heads, head_dim)
        k = k_cache.index_select(0, decode.table).view(shape)[:, :decode.max_len]
        v = v_cache.index_select(0, decode.table).view(shape)[:, :decode.max_len]
        # a GQA group's query heads become the query rows of their KV head: no K/V expansion
        # (on 2 cores 170 us against 250 us with enable_gqa for 16 x 9/3 heads x 150 keys)
        o = F.scaled_dot_product_attention(
            (q if decode.rows is None else q[decode.rows]).reshape(num_seqs, num_kv_heads, -1, head_dim),
            k.transpose(1, 2), v.transpose(1, 2),  # (B, Hk, L, D)
            attn_mask=decode.mask, scale=scale,
        ).reshape(num_seqs, num_heads, head_dim)
        if decode.rows is None:
            return o
        out[decode.rows] = o
    _attend_prefill(out, q, k_cache, v_cache, prefill, scale)
    return out


def prefill_attention_into(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
) -> None:
    """The rows of sequences with several new tokens only, written into out (the CPU ops compute
    the decode rows their own way)."""
    _, prefill = _plan_for(q, k_cache, block_tables, seq_lens, query_start_loc)
    _attend_prefill(out, q, k_cache, v_cache, prefill, scale)


def _plan_for(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor) -> tuple[_DecodePlan | None, list[_PrefillPlan]]:
    block_size, num_tokens = k_cache.shape[1], q.shape[0]
    return _attention_plan.get(
        (block_tables, seq_lens, query_start_loc, block_size, num_tokens),
        lambda: _plan_attention(block_tables, seq_lens, query_start_loc, block_size, num_tokens))


def _attend_prefill(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    prefill: list[_PrefillPlan], scale: float) -> None:
    gqa = q.shape[1] != k_cache.shape[2]
    for seq in prefill:
        k = k_cache[seq.table].flatten(0, 1)[:seq.length]  # (length, Hk, D)
        v = v_cache[seq.table].flatten(0, 1)[:seq.length]
        o = F.scaled_dot_product_attention(
            q[seq.start:seq.end].transpose(0, 1),  # (H, q_len, D)
            k.transpose(0, 1), v.transpose(0, 1),  # (Hk, length, D)
            attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=gqa,
        )
        out[seq.start:seq.end] = o.transpose(0, 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (num_tokens, hidden) -> normalised copy, computed in float32."""
    if x.dtype == weight.dtype == torch.float32 and x.shape[0] <= 64:
        # torch's fused kernel: bit-identical to the steps below in float32 and quicker for the few
        # rows of a decode step (34 against 48 us for 16 x 576 on 2 cores), but single-threaded,
        # so 3.6x slower for an 864-row prefill
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight."""
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q (T, Hq, D) and k (T, Hk, D) in place, GPT-NeoX style (halves, as HF Llama).

    cos_sin_cache (max_position, D) holds cos in [:, :D/2] and sin in [:, D/2:], float32; the
    llama3 frequency scaling is baked into it by the model, so the op is the same for both.
    """
    half = q.shape[-1] // 2

    def plan() -> tuple[torch.Tensor, torch.Tensor]:
        cs = cos_sin_cache[positions.long()]
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # (T, 1, D) each

    cos, sin = _rotary_plan.get((positions, cos_sin_cache), plan)
    for t in (q, k):
        # x * cos + rotate_half(x) * sin, the same float operations as HF's apply_rotary_pos_emb
        x = t.float()
        rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
        t.copy_(x * cos + rotated * sin)
