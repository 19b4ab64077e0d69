"""Plain-torch reference ops: the specification the Triton and C kernels are tested against, and
the engine's path where neither runs (`ReferenceOps`, at the end, takes the step plan).

Layouts (shared by every implementation; `step_plan.py` lists the per-step index tensors):
  q, out        (num_tokens, num_heads, head_dim)            varlen batch, sequences back to back
  k_cache/v_cache (num_blocks, block_size, num_kv_heads, head_dim)
  block_tables  (num_seqs, max_blocks) int32                  block ids of each sequence, in order
  seq_lens      (num_seqs,) int32      context length per sequence, new tokens included
  query_start_loc (num_seqs + 1,) int32 cumulative query lengths; sequence i owns rows
                qsl[i]:qsl[i+1] of q, which are its last (qsl[i+1]-qsl[i]) context positions
  slot_mapping  (num_tokens,) int64    flat slot (block_id * block_size + offset); -1 = skip
  kv_scales     (2,) float32           a layer's (k_scale, v_scale), read when the caches hold FP8
                                       (`kv_quant.py`): the ops then de-quantise what they read
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.kernels.interface import Ops
from kvpilot.kernels.kv_quant import FP8, FP8_MAX, check_scales, dequantize, quantize
from kvpilot.kernels.step_plan import (
    AttentionIndex,
    PrefillIndex,
    RotaryRows,
    StepPlan,
    WriteIndex,
    plan_attention,
    plan_rotary,
    plan_write,
)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, index: WriteIndex | None = None, kv_scales: torch.Tensor | None = None,
) -> None:
    """Scatter the new tokens' keys and values into their cache slots, in place (quantised when
    the caches hold FP8). `index` is slot_mapping already split into blocks and offsets
    (`StepPlan.write`)."""
    scales = check_scales(kv_scales, k_cache)
    rows, blocks, offsets = plan_write(slot_mapping, k_cache.shape[1]) if index is None else index
    if rows is not None:
        k, v = k[rows], v[rows]
    if scales is not None:
        k, v = quantize(k, scales[0]), quantize(v, scales[1])
    # (block, offset) indexing works for any physical layout (see `kv_cache_empty`)
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def kv_cache_empty(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                   head_major: bool, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed cache of the contract's shape (num_blocks, block_size, num_kv_heads, head_dim).

    head_major stores it as (num_blocks, num_kv_heads, block_size, head_dim) and returns the
    transposed view: each (block, KV head) is then one contiguous run of block_size * head_dim
    elements instead of block_size rows of head_dim scattered num_kv_heads rows apart. Every op
    takes either (they use strides); the GPU engine allocates head-major
    (benchmarks/history/2026-12-03.md, "Kernels").
    """
    if not head_major:
        return torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device).transpose(1, 2)


def _read(rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as the attention reads them: de-quantised into q's dtype from FP8."""
    return rows if scale is None else dequantize(rows, scale, dtype)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int | None = None,
    *, index: AttentionIndex | None = None, kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.
    `max_query_len` is the Triton launcher's hint (see `paged_attention/launcher.py`); the index
    here reads the lengths from the index tensors anyway, so it is not needed. `index` is that
    index work done already (`StepPlan.attention`, shared by every layer of a step). FP8 caches
    are de-quantised with `kv_scales` as they are read, and attention runs in q's dtype.

    Decode sequences (one new token) are batched into one padded call; sequences with several
    new tokens (prefill, chunked prefill) are computed one by one.
    """
    if index is None:
        index = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1], q.shape[0])
    scales = check_scales(kv_scales, k_cache)
    k_scale, v_scale = (None, None) if scales is None else (scales[0], scales[1])
    decode, prefill = index
    out = torch.empty_like(q)
    if decode is not None:
        num_seqs, num_heads, head_dim = decode.num_seqs, q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        # index_select on the block dim: one contiguous copy of each sequence's blocks
        shape = (num_seqs, -1, num_kv_heads, head_dim)
        k = _read(k_cache.index_select(0, decode.table).view(shape)[:, :decode.max_len], k_scale, q.dtype)
        v = _read(v_cache.index_select(0, decode.table).view(shape)[:, :decode.max_len], v_scale, q.dtype)
        # a GQA group's query heads become the query rows of their KV head: no K/V expansion,
        # quicker than SDPA's enable_gqa here (benchmarks/history/2026-12-03.md, "Engine core
        # on CPU")
        o = F.scaled_dot_product_attention(
            (q if decode.rows is None else q[decode.rows]).reshape(num_seqs, num_kv_heads, -1, head_dim),
            k.transpose(1, 2), v.transpose(1, 2),  # (B, Hk, L, D)
            attn_mask=decode.mask, scale=scale,
        ).reshape(num_seqs, num_heads, head_dim)
        if decode.rows is None:
            return o
        out[decode.rows] = o
    prefill_attention_into(out, q, k_cache, v_cache, prefill, scale, scales)
    return out


def prefill_attention_into(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           prefill: list[PrefillIndex], scale: float, kv_scales: torch.Tensor | None = None) -> None:
    """The rows of sequences with several new tokens only, written into out (the CPU ops compute
    the decode rows their own way)."""
    scales = check_scales(kv_scales, k_cache)
    k_scale, v_scale = (None, None) if scales is None else (scales[0], scales[1])
    gqa = q.shape[1] != k_cache.shape[2]
    for seq in prefill:
        k = _read(k_cache[seq.table].flatten(0, 1)[:seq.length], k_scale, q.dtype)  # (length, Hk, D)
        v = _read(v_cache[seq.table].flatten(0, 1)[:seq.length], v_scale, q.dtype)
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
        # rows of a decode step, but single-threaded, so slower for a prefill's many rows
        # (benchmarks/history/2026-12-03.md, "Engine core on CPU")
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
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    rows: RotaryRows | None = None,
) -> None:
    """Rotate q (T, Hq, D) and k (T, Hk, D) in place, GPT-NeoX style (halves, as HF Llama).

    cos_sin_cache (max_position, D) holds cos in [:, :D/2] and sin in [:, D/2:], float32; the
    llama3 frequency scaling is baked into it by the model, so the op is the same for both.
    `rows` are the positions' cos and sin already gathered (`StepPlan.rotary`).
    """
    half = q.shape[-1] // 2
    cos, sin = plan_rotary(positions, cos_sin_cache) if rows is None else rows
    for t in (q, k):
        # x * cos + rotate_half(x) * sin, the same float operations as HF's apply_rotary_pos_emb
        x = t.float()
        rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
        t.copy_(x * cos + rotated * sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) -> silu(x[:, :I]) * x[:, I:], as HF's LlamaMLP computes it (two roundings)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# FP8 activations and weights share the KV cache's e4m3 format (kv_quant.py).
# Smallest per-token scale: a row of zeros still divides by something (vLLM's floor).
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) -> (q (T, K) float8_e4m3fn, scales (T, 1) float32), q * scales ~ x. Per row: the
    row's largest magnitude / 448, floored at FP8_MIN_SCALE; or the static `scale` (1,) for every
    row. x / scale in float32, saturated at +-448 before the cast (round to nearest even)."""
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)
        # divided by a tensor, not the Python number: CUDA torch turns a division by a scalar into a
        # product with its reciprocal, which can differ from the division in the last place
        scales = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=FP8_MIN_SCALE)
    else:
        scales = scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


class ReferenceOps(Ops):
    """The reference as the engine calls it: the plan's index work is shared by every layer."""

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan,
                        scale: float, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        plan.check_block_size(k_cache)
        return paged_attention(q, k_cache, v_cache, plan.block_tables, plan.seq_lens, plan.query_start_loc,
                               scale, index=plan.attention, kv_scales=kv_scales)

    def write_kv_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       plan: StepPlan, kv_scales: torch.Tensor | None = None) -> None:
        plan.check_block_size(k_cache)
        write_kv_cache(k, v, k_cache, v_cache, plan.slot_mapping, plan.write, kv_scales)

    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, plan: StepPlan) -> None:
        rotary_embedding(plan.positions, q, k, plan.cos_sin_cache, plan.rotary)

    silu_and_mul = staticmethod(silu_and_mul)
    rms_norm = staticmethod(rms_norm)
    fused_add_rms_norm = staticmethod(fused_add_rms_norm)
    quantize_fp8 = staticmethod(quantize_fp8)

    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.quantize_fp8(self.rms_norm(x, weight, eps), scale)

    def fused_add_rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        residual.add_(x)
        return self.quantize_fp8(self.rms_norm(residual, weight, eps), scale)

    def silu_and_mul_fp8(self, x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.quantize_fp8(self.silu_and_mul(x), scale)
