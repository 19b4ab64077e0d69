"""Rotary position embedding, GPT-NeoX style (rotate halves), in place on q and k; and the same
fused with the KV-cache write of the rotated keys and the values (`rotary_and_write_kv`).

positions (num_tokens,) int32/int64; q (num_tokens, num_heads, head_dim) and k, v (num_tokens,
num_kv_heads, head_dim), unit stride in head_dim; cos_sin_cache (max_position, head_dim) float32
contiguous, cos in [:, :head_dim/2] and sin in [:, head_dim/2:] (llama3 scaling is baked in by the
model). One program rotates every head of q and k of one token, so cos/sin are read once; fused,
it also stores the token's rotated keys and its values in their cache slot (`cache.py`'s layout,
slot mapping and FP8 quantisation), one launch a layer instead of two. The cache then holds
exactly the rotated k (rounded to k's dtype, then quantised when the cache holds FP8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels import cache
from kvpilot.kernels.cache import cache_value, load_scales, slot_ptrs
from kvpilot.kernels.checks import FLOAT_DTYPES, check_contiguous, check_shape, check_tensor
from kvpilot.kernels.host import next_power_of_2


@triton.jit
def _rotate(ptr, stride_h, cos, sin, NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr,
            HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Rotate the heads at ptr in place; returns the rotated halves, rounded as stored."""
    h = tl.arange(0, H_PAD)
    c = tl.arange(0, HALF_PAD)
    mask = (h[:, None] < NUM_HEADS) & (c[None, :] < HALF)
    ptrs = ptr + h[:, None] * stride_h + c[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    y1 = (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype)
    y2 = (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype)
    tl.store(ptrs, y1, mask=mask)
    tl.store(ptrs + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, kv_scales_ptr, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HQ_PAD: tl.constexpr,
    HK_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid (num_tokens,). WRITE_KV also stores the token's rotated k and its v at its slot
    (k_cache/v_cache strides stride_c*/stride_d* over (block, slot, head); slot -1 skips), with
    KV_FP8 quantised by the (k_scale, v_scale) at kv_scales_ptr; the cache arguments are unused
    without WRITE_KV."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    c = tl.arange(0, HALF_PAD)
    row = cos_sin_ptr + pos * (2 * HALF)
    cos = tl.load(row + c, mask=c < HALF, other=0.0)
    sin = tl.load(row + HALF + c, mask=c < HALF, other=0.0)
    _rotate(q_ptr + tok * stride_qt, stride_qh, cos, sin, NUM_HEADS, HQ_PAD, HALF, HALF_PAD)
    k1, k2 = _rotate(k_ptr + tok * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, HK_PAD, HALF, HALF_PAD)
    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
        if slot >= 0:
            k_scale, v_scale = load_scales(kv_scales_ptr, KV_FP8)
            h = tl.arange(0, HK_PAD)
            mask = (h[:, None] < NUM_KV_HEADS) & (c[None, :] < HALF)
            kc = slot_ptrs(k_cache_ptr, slot, h, c, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
            tl.store(kc, cache_value(k1, k_scale, k_cache_ptr, KV_FP8), mask=mask)
            tl.store(kc + HALF, cache_value(k2, k_scale, k_cache_ptr, KV_FP8), mask=mask)
            v = v_ptr + tok * stride_vt + h[:, None] * stride_vh + c[None, :]
            vc = slot_ptrs(v_cache_ptr, slot, h, c, stride_db, stride_ds, stride_dh, BLOCK_SIZE)
            tl.store(vc, cache_value(tl.load(v, mask=mask), v_scale, v_cache_ptr, KV_FP8), mask=mask)
            tl.store(vc + HALF, cache_value(tl.load(v + HALF, mask=mask), v_scale, v_cache_ptr, KV_FP8), mask=mask)


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    check_tensor("q", q, 3, FLOAT_DTYPES)
    num_tokens, _, head_dim = q.shape
    check_tensor("k", k, 3, (q.dtype,), q.device)
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k must have shape ({num_tokens}, num_kv_heads, {head_dim}), got {tuple(k.shape)}")
    check_tensor("positions", positions, 1, (torch.int64, torch.int32), q.device)
    check_shape("positions", positions, (num_tokens,))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, (torch.float32,), q.device)
    check_contiguous("cos_sin_cache", cos_sin_cache)
    if head_dim % 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be (max_position, {head_dim}) with an even head_dim, "
                         f"got {tuple(cos_sin_cache.shape)}")


def _launch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
            v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
            write_kv: bool, kv_scales: torch.Tensor | None = None) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v, k_cache, v_cache, slot_mapping, positions if kv_scales is None else kv_scales, v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HQ_PAD=next_power_of_2(num_heads),
        HK_PAD=next_power_of_2(k.shape[1]), HALF=half, HALF_PAD=next_power_of_2(half),
        WRITE_KV=write_kv, BLOCK_SIZE=k_cache.shape[1] if write_kv else 1, KV_FP8=kv_scales is not None,
        num_warps=4,
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q (T, Hq, D) and k (T, Hk, D) in place by the cos/sin rows of `positions`."""
    _check(positions, q, k, cos_sin_cache)
    unused = q.unsqueeze(0)  # 4 dims, as the cache arguments the kernel leaves alone
    _launch(positions, q, k, cos_sin_cache, k, unused, unused, positions, write_kv=False)


def rotary_and_write_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """`rotary_embedding`, then `cache.write_kv_cache(k, v, k_cache, v_cache, slot_mapping,
    kv_scales)`, in one launch."""
    _check(positions, q, k, cos_sin_cache)
    scales = cache.check(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    _launch(positions, q, k, cos_sin_cache, v, k_cache, v_cache, slot_mapping, write_kv=True, kv_scales=scales)
