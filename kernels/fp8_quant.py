"""FP8 activations for FP8 linear layers: rows quantized to float8 e4m3 with one float32 scale
per row (token), the format `reference.quantize_fp8` specifies; optionally SwiGLU's silu(gate) *
up computed on the way (the input of the down projection), so its product is never written in
the model's dtype.

x (num_tokens, width) (or (num_tokens, 2 * width), gate then up, for the SiLU variant), unit
stride in its last dim; q (num_tokens, width) float8_e4m3fn and scales (num_tokens, 1) float32,
contiguous. One program per row makes two passes over it: the row's largest magnitude, then the
quantized values (recomputed rather than kept: a row of the MLP is wider than a program's
registers). A static scale (1,) float32 replaces the first pass. The jit helpers here are shared
with the RMSNorm kernel (norm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.activation import silu_mul
from kvpilot.kernels.checks import FLOAT_DTYPES, check_tensor
from kvpilot.kernels.host import INTERPRETING
from kvpilot.kernels.kv_quant import FP8, FP8_MAX
from kvpilot.kernels.reference import FP8_MIN_SCALE

__all__ = ["FP8", "check_static_scale", "quantize_fp8", "quantize_row", "row_scale", "silu_and_mul_fp8"]

_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)
BLOCK = 1024  # elements of a row per loop iteration


@triton.jit
def row_scale(amax, static_scale_ptr, STATIC: tl.constexpr):
    """The row's scale: the static one, or amax / 448 (rounded as torch divides) floored."""
    if STATIC:
        return tl.load(static_scale_ptr).to(tl.float32)
    return tl.maximum(tl.math.div_rn(amax, _MAX), _MIN_SCALE)


@triton.jit
def quantize_row(y, scale):
    """float32 values -> e4m3: y / scale rounded as torch divides, saturated, then cast."""
    return tl.clamp(tl.math.div_rn(y, scale), -_MAX, _MAX).to(tl.float8e4nv)


@triton.jit
def _row_values(x_ptr, row, stride_x, cols, mask, width, SILU_MUL: tl.constexpr, LIBDEVICE: tl.constexpr):
    """One block of the row's values in float32 (silu(gate) * up, rounded to x's dtype, with SILU_MUL)."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if SILU_MUL:
        up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0)
        x = silu_mul(x, up, LIBDEVICE)
    return x.to(tl.float32)


@triton.jit
def _quantize_rows_kernel(q_ptr, scales_ptr, x_ptr, static_scale_ptr, width, stride_x, stride_q,
                          BLOCK: tl.constexpr, SILU_MUL: tl.constexpr, STATIC: tl.constexpr,
                          LIBDEVICE: tl.constexpr):
    """Grid (num_tokens,)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = 0.0
    if not STATIC:
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + offs
            mask = cols < width
            v = _row_values(x_ptr, row, stride_x, cols, mask, width, SILU_MUL, LIBDEVICE)
            peak = tl.maximum(peak, tl.abs(v))
        amax = tl.max(peak, 0)
    scale = row_scale(amax, static_scale_ptr, STATIC)
    tl.store(scales_ptr + row, scale)
    for start in range(0, width, BLOCK):
        cols = start + offs
        mask = cols < width
        v = _row_values(x_ptr, row, stride_x, cols, mask, width, SILU_MUL, LIBDEVICE)
        tl.store(q_ptr + row * stride_q + cols, quantize_row(v, scale), mask=mask)


def check_static_scale(scale: torch.Tensor | None, device: torch.device) -> None:
    if scale is None:
        return
    if not isinstance(scale, torch.Tensor) or scale.shape != (1,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be a (1,) float32 tensor, got {getattr(scale, 'shape', scale)} "
                         f"{getattr(scale, 'dtype', '')}")
    if scale.device != device:
        raise ValueError(f"scale is on {scale.device}, expected {device}")


def _quantize(x: torch.Tensor, width: int, scale: torch.Tensor | None,
              silu_mul: bool) -> tuple[torch.Tensor, torch.Tensor]:
    check_static_scale(scale, x.device)
    num_tokens = x.shape[0]
    q = torch.empty((num_tokens, width), dtype=FP8, device=x.device)
    scales = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens and width:
        _quantize_rows_kernel[(num_tokens,)](
            q, scales, x, scale if scale is not None else scales, width, x.stride(0), q.stride(0),
            BLOCK=BLOCK, SILU_MUL=silu_mul, STATIC=scale is not None, LIBDEVICE=not INTERPRETING, num_warps=4)
    return q, scales


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) -> (q, scales)."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    return _quantize(x, x.shape[1], scale, silu_mul=False)


def silu_and_mul_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, 2I), gate and up side by side -> silu(gate) * up (T, I), quantized: (q, scales)."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    if x.shape[1] % 2:
        raise ValueError(f"x must hold gate and up halves of equal width, got {x.shape[1]} columns")
    return _quantize(x, x.shape[1] // 2, scale, silu_mul=True)
