"""The integer-weight product for decode-sized batches: y (M, N) = x (M, K) @ W^T, M <= 64.

Bound by reading the packed weights, so the grid is many narrow programs: (cdiv(N, BLOCK_N),
SPLIT_K, cdiv(M, BLOCK_M)). Each program walks its slice of K in BLOCK_K steps: one tile of
packed words per step (BLOCK_N rows of BLOCK_K * bits / 8 contiguous bytes), de-quantised in
registers (`unpack.dequant_tile`) and multiplied on the tensor cores (BLOCK_M >= 16: rows past M
are masked). With SPLIT_K > 1 each slice of K writes float32 partials (SPLIT_K, M, N) that the
launcher sums: more programs where N alone gives too few to keep every SM reading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpilot.kernels.host import cdiv
from kvpilot.kernels.int_gemm.layout import IntWeight
from kvpilot.kernels.int_gemm.unpack import dequant_tile, load_activations


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 32  # output features per program
    block_k: int = 128  # inputs per step (at most the group size; the launcher halves it to fit)
    split_k: int = 1  # slices of K, each its own program
    num_warps: int = 4
    num_stages: int = 4


@triton.jit(do_not_specialize=["M"])  # M varies from step to step: one compile for all
def _decode_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, M, N, K,
                   stride_xm, stride_qn, stride_sg, stride_os, stride_om,
                   GROUP: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_len = K // SPLIT_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(pid_s * k_len, (pid_s + 1) * k_len, BLOCK_K):
        x = load_activations(x_ptr, perm_ptr, offs_m, mask_m, k0, stride_xm, HAS_PERM, BLOCK_K)
        w = dequant_tile(qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, stride_qn, stride_sg, GROUP, BITS, BLOCK_K)
        if IEEE:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    out_ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def launch(x: torch.Tensor, w: IntWeight, out: torch.Tensor, config: DecodeConfig, block_m: int,
           block_k: int) -> None:
    """Checked by the launcher: out is (M, N) in x's dtype, or (split_k, M, N) float32 partials."""
    m, k = x.shape
    n = w.out_features
    perm = w.perm if w.perm is not None else w.qweight  # any pointer: unread without act-order
    stride_os = out.stride(0) if config.split_k > 1 else 0
    stride_om = out.stride(-2)
    grid = (cdiv(n, config.block_n), config.split_k, cdiv(m, block_m))
    _decode_kernel[grid](
        x, w.qweight, w.scales, w.zeros, perm, out, m, n, k,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), stride_os, stride_om,
        GROUP=w.group_size, BITS=w.bits, HAS_PERM=w.perm is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        SPLIT_K=config.split_k, num_warps=config.num_warps, num_stages=config.num_stages,
    )
