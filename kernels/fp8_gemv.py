"""FP8 products for a few rows (decode batches of at most `MAX_ROWS` tokens): y = (x W^T) * x_scale
* w_scale (+ bias), with x and W float8 e4m3 and their scales per row (token) and per output
channel, as `torch._scaled_mm` with row-wise scales computes them.

Such a product only streams the weight, once; cuBLASLt's FP8 kernels are tiled for many rows and
leave bandwidth unused there (benchmarks/bench_fp8_gpu.py compares the two per shape). Here each
program owns BLOCK_N output channels and walks the whole of K: it loads a (BLOCK_N, BLOCK_K) tile of
W and the (MAX_ROWS, BLOCK_K) tile of x (rows past M masked, so never read), widens both to fp16
(exact: every e4m3 value is an fp16 value) and accumulates their product in float32 with tl.dot;
the scales and the bias are applied once, at the end.

x (M, K) float8_e4m3fn, unit stride in K; x_scales (M, 1) float32 contiguous; w (N, K)
float8_e4m3fn, unit stride in K; w_scales (N, 1) float32 contiguous; bias (N,) or None; out (M, N)
in `out_dtype`, contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.checks import FLOAT_DTYPES, check_contiguous, check_shape, check_tensor
from kvpilot.kernels.host import cdiv
from kvpilot.kernels.kv_quant import FP8

MAX_ROWS = 16  # the rows one program's tile holds (tl.dot's smallest dimension)
BLOCK_N = 16
BLOCK_K = 512


@triton.jit(do_not_specialize=["M"])  # M varies from step to step: one compile for all
def _fp8_gemv_kernel(out_ptr, x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, M, N, K, stride_x, stride_w, stride_o,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N),)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels
    rows = tl.arange(0, BLOCK_M)
    in_n, in_m = cols < N, rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        in_k = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=in_m[:, None] & in_k[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :], mask=in_n[:, None] & in_k[None, :],
                    other=0.0)
        acc = tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
    acc *= tl.load(xs_ptr + rows, mask=in_m, other=0.0)[:, None] * tl.load(ws_ptr + cols, mask=in_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def fp8_gemv(x: torch.Tensor, x_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(M, K) x (N, K)^T -> (M, N) in out_dtype, M <= MAX_ROWS."""
    check_tensor("x", x, 2, (FP8,))
    check_tensor("w", w, 2, (FP8,), x.device)
    (m, k), n = x.shape, w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"x has {m} rows; this kernel takes at most {MAX_ROWS}")
    check_shape("w", w, (n, k))
    for name, scales, rows in (("x_scales", x_scales, m), ("w_scales", w_scales, n)):
        check_tensor(name, scales, 2, (torch.float32,), x.device)
        check_contiguous(name, scales)
        check_shape(name, scales, (rows, 1))
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES, x.device)
        check_shape("bias", bias, (n,))
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m and n:
        _fp8_gemv_kernel[(cdiv(n, BLOCK_N),)](
            out, x, x_scales, w, w_scales, bias if bias is not None else w_scales, m, n, k,
            x.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, HAS_BIAS=bias is not None, num_warps=4, num_stages=3)
    return out
