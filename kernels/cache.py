"""Scatter new tokens' keys and values into the paged KV cache.

k/v (num_tokens, num_kv_heads, head_dim); k_cache/v_cache (num_blocks, block_size, num_kv_heads,
head_dim); slot_mapping (num_tokens,) int64 or int32, flat slot = block_id * block_size + offset,
-1 for padding tokens that are skipped. One program copies one token's heads (a
(num_kv_heads, head_dim) tile) for K and V. Caches of float8_e4m3fn get x / scale, saturated
(`kv_quant.py`), with the layer's kv_scales (2,) float32 [k_scale, v_scale] read from the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.checks import (
    CACHE_DTYPES,
    FLOAT_DTYPES,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from kvpilot.kernels.host import next_power_of_2
from kvpilot.kernels.kv_quant import FP8_MAX, check_scales

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def cache_value(x, scale, cache_ptr, KV_FP8: tl.constexpr):
    """x as stored in the cache at cache_ptr: rounded to its dtype, or for an FP8 cache
    x / scale saturated to e4m3's range (the division rounded to nearest, as torch's)."""
    if KV_FP8:
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -_FP8_MAX, _FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def load_scales(kv_scales_ptr, KV_FP8: tl.constexpr):
    """(k_scale, v_scale) of an FP8 cache; (1, 1) for others, which leave kv_scales_ptr unread."""
    if KV_FP8:
        return tl.load(kv_scales_ptr), tl.load(kv_scales_ptr + 1)
    return 1.0, 1.0


@triton.jit
def slot_ptrs(cache_ptr, slot, h, cols, stride_b, stride_s, stride_h, BLOCK_SIZE: tl.constexpr):
    """Pointers to columns `cols` of heads `h` in the cache slot `slot` (flat, int64); the fused
    rotary kernel (`rotary.py`) writes through the same addressing."""
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    return cache_ptr + block * stride_b + offset * stride_s + h[:, None] * stride_h + cols[None, :]


@triton.jit
def _write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, kv_scales_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    k_scale, v_scale = load_scales(kv_scales_ptr, KV_FP8)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(slot_ptrs(k_cache_ptr, slot, h, d, stride_cb, stride_cs, stride_ch, BLOCK_SIZE),
             cache_value(k, k_scale, k_cache_ptr, KV_FP8), mask=mask)
    tl.store(slot_ptrs(v_cache_ptr, slot, h, d, stride_db, stride_ds, stride_dh, BLOCK_SIZE),
             cache_value(v, v_scale, v_cache_ptr, KV_FP8), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None,
) -> None:
    """Scatter the new tokens' keys and values into their cache slots, in place (quantised with
    kv_scales when the caches hold FP8)."""
    scales = check(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, slot_mapping if scales is None else scales,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=next_power_of_2(num_kv_heads),
        D_PAD=next_power_of_2(head_dim), BLOCK_SIZE=block_size, KV_FP8=scales is not None, num_warps=4,
    )


def check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor | None:
    """The layouts the module docstring gives, as ValueErrors naming the argument; the scales
    the kernel reads (None for caches of k's dtype)."""
    check_tensor("k_cache", k_cache, 4, CACHE_DTYPES)
    device = k_cache.device
    check_tensor("v_cache", v_cache, 4, CACHE_DTYPES, device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_same_dtype("v_cache", v_cache, "k_cache", k_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_tensor("k", k, 3, FLOAT_DTYPES, device)
    num_tokens = k.shape[0]
    check_shape("k", k, (num_tokens, num_kv_heads, head_dim))
    check_tensor("v", v, 3, FLOAT_DTYPES, device)
    check_shape("v", v, (num_tokens, num_kv_heads, head_dim))
    check_same_dtype("v", v, "k", k)
    scales = check_scales(kv_scales, k_cache)
    if scales is None:
        check_same_dtype("k", k, "k_cache", k_cache)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32), device)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    return scales
