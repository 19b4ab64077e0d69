"""The split-K partials of the decode kernels summed: (split, M, N) float32 -> (M, N) in the
output's dtype, in one launch where torch takes two (the sum, then the cast)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.host import cdiv


@triton.jit
def _sum_splits_kernel(partials_ptr, out_ptr, size, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in tl.static_range(SPLIT):
        acc += tl.load(partials_ptr + i * size + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partials: torch.Tensor, out: torch.Tensor) -> None:
    """out (M, N) = partials (split, M, N) float32 summed over the splits, both contiguous."""
    size = out.numel()
    block = 1024
    _sum_splits_kernel[(cdiv(size, block),)](partials, out, size, SPLIT=partials.shape[0], BLOCK=block)
