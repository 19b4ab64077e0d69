"""The integer-weight product for larger batches (prefill, big decode batches): y (M, N) =
x (M, K) @ W^T, bound by the tensor cores rather than by the weights' bytes.

A classic tiled GEMM, grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),), programs ordered in groups of
GROUP_M row tiles so that the row tiles sharing a weight tile run together and find it in L2.
Each inner step de-quantises one (BLOCK_N, BLOCK_K) weight tile into the activations' dtype
(`unpack.dequant_tile`) and feeds it to `tl.dot`; that cost is shared by the BLOCK_M rows.
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
class PrefillConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64  # at most the group size (the launcher halves it to fit)
    group_m: int = 8  # row tiles that take their weight tiles in the same order
    num_warps: int = 8
    num_stages: int = 3


@triton.jit(do_not_specialize=["M"])  # M varies from step to step: one compile for all
def _prefill_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, M, N, K,
                    stride_xm, stride_qn, stride_sg, stride_om,
                    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr, IEEE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = load_activations(x_ptr, perm_ptr, offs_m, mask_m, k0, stride_xm, HAS_PERM, BLOCK_K)
        w = dequant_tile(qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, stride_qn, stride_sg, GROUP, BITS, BLOCK_K)
        if IEEE:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def launch(x: torch.Tensor, w: IntWeight, out: torch.Tensor, config: PrefillConfig, block_k: int) -> None:
    """Checked by the launcher: out is (M, N) in x's dtype."""
    m, k = x.shape
    n = w.out_features
    perm = w.perm if w.perm is not None else w.qweight  # any pointer: unread without act-order
    grid = (cdiv(m, config.block_m) * cdiv(n, config.block_n),)
    _prefill_kernel[grid](
        x, w.qweight, w.scales, w.zeros, perm, out, m, n, k,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        GROUP=w.group_size, BITS=w.bits, HAS_PERM=w.perm is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
