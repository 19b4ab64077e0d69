"""Device functions both integer-weight kernels share: a tile of packed words to de-quantised
float32 weights.

A tile (BLOCK_N rows, BLOCK_K // pack words) is loaded once, and each word is repeated `pack`
times along K by `tl.interleave`, which keeps a word's copies in the thread that loaded it (no
data moves between threads); a per-column shift and mask then leave one integer per element.
Integers become floats without a conversion instruction (those run at a quarter of the FMA rate):
OR-ing q < 2**23 into the mantissa of 2**23 gives the float 2**23 + q exactly, and subtracting
2**23 + zero leaves q - zero exactly; times the scale is exact in float32 too (at most 8 + 11
significant bits), so the one rounding is the caller's cast to the activations' dtype, as in the
torch twin (`layout.dequantize`).
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC_BITS = tl.constexpr(0x4B000000)  # float32 2**23
MAGIC = tl.constexpr(8388608.0)


@triton.jit
def expand_words(words, BITS: tl.constexpr):
    """(R, C) packed int32 -> (R, C * 32 // BITS): column j holds word j // (32 // BITS)."""
    w = tl.interleave(words, words)
    w = tl.interleave(w, w)
    if BITS == 4:
        w = tl.interleave(w, w)
    return w


@triton.jit
def dequant_tile(qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, stride_qn, stride_sg,
                 GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights [offs_n, k0:k0 + BLOCK_K] de-quantised, (BLOCK_N, BLOCK_K) float32; the tile lies
    in one group (BLOCK_K divides GROUP and k0 is a multiple of BLOCK_K)."""
    offs_w = k0 * BITS // 32 + tl.arange(0, BLOCK_K * BITS // 32)
    words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_w[None, :], mask=mask_n[:, None], other=0)
    shifts = (tl.arange(0, BLOCK_K) % (32 // BITS)) * BITS
    q = (expand_words(words, BITS) >> shifts[None, :]) & ((1 << BITS) - 1)
    g = k0 // GROUP
    s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    qf = (q | MAGIC_BITS).to(tl.float32, bitcast=True)
    return (qf - (z + MAGIC)[:, None]) * s[:, None]


@triton.jit
def load_activations(x_ptr, perm_ptr, offs_m, mask_m, k0, stride_xm, HAS_PERM: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """x[offs_m, k0:k0 + BLOCK_K], or the columns perm[k0:k0 + BLOCK_K] of x with act-order."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if HAS_PERM:
        offs_k = tl.load(perm_ptr + offs_k)
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
