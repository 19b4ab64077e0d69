"""The FP8 KV cache's number format: float8 e4m3 with one scale per layer for K and one for V.

A cache that holds `FP8` (torch.float8_e4m3fn) stores x / scale, saturated to e4m3's largest
finite value (`FP8_MAX`, 448), and is read back as stored * scale. A layer's scales travel as one
(2,) float32 tensor [k_scale, v_scale] on the cache's device, "kv_scales"; the Triton kernels load
them through a pointer, so CUDA graphs captured earlier read whatever values the tensor holds.
Every op takes kv_scales and uses it only when the cache holds FP8: caches of the model's own
dtype ignore it.

The saturation is explicit (a clamp before the cast) in every implementation, so that the torch
reference and the kernels agree past the range whatever their cast does there.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) -> FP8 holding x / scale, saturated; the division in float32."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 x -> x * scale in `dtype` (the product in float32, then rounded once)."""
    return (x.float() * scale).to(dtype)


def check_scales(kv_scales: torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor | None:
    """kv_scales as the ops need them for `cache`: None for a cache of the model's dtype, else a
    (2,) float32 tensor on the cache's device (ValueError naming what is wrong)."""
    if not is_fp8(cache):
        return None
    if kv_scales is None:
        raise ValueError("kv_scales: an FP8 cache needs its layer's (k_scale, v_scale)")
    if kv_scales.shape != (2,) or kv_scales.dtype != torch.float32 or not kv_scales.is_contiguous():
        raise ValueError(f"kv_scales must be a contiguous (2,) float32 tensor, got {tuple(kv_scales.shape)} "
                         f"{kv_scales.dtype}")
    if kv_scales.device != cache.device:
        raise ValueError(f"kv_scales is on {kv_scales.device}, the cache on {cache.device}")
    return kv_scales
