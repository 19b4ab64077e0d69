"""SwiGLU's activation: silu(gate) * up in one pass over the gate/up projection's output.

x (num_tokens, 2 * intermediate), unit stride in its last dim, gate in the first half of each row
and up in the second (the model's fused gate_up projection); out (num_tokens, intermediate)
contiguous. torch does it in two kernels (SiLU, then the product) that read and write the
intermediate activations twice; here each element is read once and written once. The rounding
is torch's: silu in float32 (with the accurate exp and an IEEE division, as ATen's kernel)
rounded to x's dtype, then the product in float32 rounded again, so the output is bit-identical
to `F.silu(gate) * up`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from kvpilot.kernels.checks import FLOAT_DTYPES, check_tensor
from kvpilot.kernels.host import INTERPRETING, cdiv

BLOCK = 1024  # elements of one row a program takes


@triton.jit
def silu_mul(gate, up, LIBDEVICE: tl.constexpr):
    """silu(gate) * up in gate's dtype, rounded as torch rounds it. LIBDEVICE takes CUDA's expf
    (tl.exp is a faster approximation on the GPU); Triton's interpreter has no libdevice, and its
    tl.exp is numpy's."""
    g = gate.to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    silu = tl.math.div_rn(g, 1.0 + e).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr,
                         LIBDEVICE: tl.constexpr):
    """Grid (num_tokens, cdiv(width, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up, LIBDEVICE), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) -> silu(x[:, :I]) * x[:, I:], (T, I) in x's dtype."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    num_tokens, double = x.shape
    if double % 2:
        raise ValueError(f"x must hold gate and up halves of equal width, got {double} columns")
    width = double // 2
    out = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)
    if num_tokens and width:
        _silu_and_mul_kernel[(num_tokens, cdiv(width, BLOCK))](
            out, x, width, x.stride(0), out.stride(0), BLOCK=BLOCK, LIBDEVICE=not INTERPRETING, num_warps=4)
    return out
