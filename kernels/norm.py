"""RMSNorm and fused residual-add + RMSNorm, optionally quantizing their output to FP8 for an FP8
linear layer (`fp8_quant.py` defines the number format and the per-token scales).

x/residual (num_tokens, hidden), unit stride in hidden; weight (hidden,) contiguous. One program
normalises one row in float32, rounding exactly where `reference.py` does (the sum is rounded to
the residual's dtype before it is normalised, the normalised row to x's dtype before it is
quantized). Quantized: q (num_tokens, hidden) float8_e4m3fn and scales (num_tokens, 1) float32
contiguous; x is then left unwritten.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.checks import FLOAT_DTYPES, check_contiguous, check_shape, check_tensor
from kvpilot.kernels.fp8_quant import FP8, check_static_scale, quantize_row, row_scale
from kvpilot.kernels.host import next_power_of_2


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, residual_ptr, weight_ptr, scales_ptr, static_scale_ptr, eps, hidden,
    stride_o, stride_x, stride_r,
    BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, STATIC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        r = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
        tl.store(residual_ptr + row * stride_r + cols, r, mask=mask)
        xf = r.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        y = (xf * rstd * w).to(x.dtype).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), 0), static_scale_ptr, STATIC)
        tl.store(scales_ptr + row, scale)
        tl.store(out_ptr + row * stride_o + cols, quantize_row(y, scale), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 1, FLOAT_DTYPES, x.device)
    check_contiguous("weight", weight)
    check_shape("weight", weight, (x.shape[1],))


def _launch(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
            eps: float, add_residual: bool, scales: torch.Tensor | None = None,
            static_scale: torch.Tensor | None = None) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    block = next_power_of_2(hidden)
    quant = scales is not None
    _rms_norm_kernel[(num_tokens,)](
        out, x, residual, weight, scales if quant else out, static_scale if static_scale is not None else weight,
        eps, hidden, out.stride(0), x.stride(0), residual.stride(0),
        BLOCK=block, ADD_RESIDUAL=add_residual, QUANT=quant, STATIC=static_scale is not None,
        num_warps=min(16, max(1, block // 512)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (num_tokens, hidden) -> normalised copy, computed in float32."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(out, x, x, weight, eps, add_residual=False)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight."""
    _check(x, weight)
    check_tensor("residual", residual, 2, FLOAT_DTYPES, x.device)
    check_shape("residual", residual, tuple(x.shape))
    _launch(x, x, residual, weight, eps, add_residual=True)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (num_tokens, hidden) -> its normalised rows quantized: (q, scales)."""
    _check(x, weight)
    check_static_scale(scale, x.device)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    _launch(q, x, x, weight, eps, add_residual=False, scales=scales, static_scale=scale)
    return q, scales


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place, then its normalised rows quantized: (q, scales); x unchanged."""
    _check(x, weight)
    check_tensor("residual", residual, 2, FLOAT_DTYPES, x.device)
    check_shape("residual", residual, tuple(x.shape))
    check_static_scale(scale, x.device)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    _launch(q, x, residual, weight, eps, add_residual=True, scales=scales, static_scale=scale)
    return q, scales
