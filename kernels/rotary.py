"""Rotary position embedding, GPT-NeoX style (rotate halves), in place on q and k.

positions (num_tokens,) int32/int64; q (num_tokens, num_heads, head_dim) and k (num_tokens,
num_kv_heads, head_dim), unit stride in head_dim; cos_sin_cache (max_position, head_dim) float32
contiguous, cos in [:, :head_dim/2] and sin in [:, head_dim/2:] (llama3 scaling is baked in by the
model). One program rotates every head of q and k of one token, so cos/sin are read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.checks import FLOAT_DTYPES, check_contiguous, check_shape, check_tensor
from kvpilot.kernels.host import next_power_of_2


@triton.jit
def _rotate(ptr, stride_h, cos, sin, NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr,
            HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    h = tl.arange(0, H_PAD)
    c = tl.arange(0, HALF_PAD)
    mask = (h[:, None] < NUM_HEADS) & (c[None, :] < HALF)
    ptrs = ptr + h[:, None] * stride_h + c[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(ptrs, (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(ptrs + HALF, (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HQ_PAD: tl.constexpr,
    HK_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    c = tl.arange(0, HALF_PAD)
    row = cos_sin_ptr + pos * (2 * HALF)
    cos = tl.load(row + c, mask=c < HALF, other=0.0)
    sin = tl.load(row + HALF + c, mask=c < HALF, other=0.0)
    _rotate(q_ptr + tok * stride_qt, stride_qh, cos, sin, NUM_HEADS, HQ_PAD, HALF, HALF_PAD)
    _rotate(k_ptr + tok * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, HK_PAD, HALF, HALF_PAD)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q (T, Hq, D) and k (T, Hk, D) in place by the cos/sin rows of `positions`."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
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
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HQ_PAD=next_power_of_2(num_heads),
        HK_PAD=next_power_of_2(k.shape[1]), HALF=half, HALF_PAD=next_power_of_2(half),
        num_warps=4,
    )
