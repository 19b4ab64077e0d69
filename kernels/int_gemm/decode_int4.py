"""The 4-bit product for decode-sized batches, de-quantising at about one instruction a weight:
y (M, N) = x (M, K) @ W^T, M <= 16, bound by reading the packed weights.

Why another kernel: `decode.py` turns each weight into a float32 (copy, shift, mask, OR a magic,
subtract the zero, multiply by the scale) and then into the activations' dtype, six or seven
instructions a weight, more than the time its half byte takes to stream. Here the zero point and
the scale leave the inner loop, and two weights share each 32-bit instruction:

  * Per word and shift s (0..3), ((word << a_s or >> b_s) & MASK) | ONES puts nibbles s and s + 4
    at the top of the mantissas of two 16-bit floats 1.0: each half is v = 1 + q / 16, exact (four
    significant bits), in the activations' 16-bit type (bfloat16 for bf16 and fp32 inputs, fp16
    for fp16: MASK/ONES 0x00780078/0x3F803F80 and 0x03C003C0/0x3C003C00). A shift and an AND-OR
    yield two weights; ptxas keeps the AND and the OR apart (two immediates), so `ASM` writes them
    as one inline-PTX `lop3.b32` (LUT 0xEA = a & b | c). The interpreter cannot run inline PTX
    and runs the Triton twin instead, so the PTX is checked on the GPU only (the GPU tests).
    The 32-bit result's halves become 16-bit floats by truncation and shift, which the compiler
    turns into register renaming.
  * The tensor cores take x and v: per step of BLOCK_K inputs (inside one group) D = x @ v^T in
    float32. Since q - z = 16 v - (16 + z), the step adds s * (16 D - (16 + z) S) to the
    accumulator, S being the step's row sums of x: per output, not per weight. S is either x @ 1
    on the tensor cores (`SUM_DOT`; the sums arrive repeated in D's layout) or a reduction.

Precision: the products x * v are exact in float32 (8 + 5 significant bits), and since v lies in
[1, 2) the cancelled part, 16 Sum x, is of the order of the part that stays, Sum x (q - z): a bit
or two of float32's 24 bits, where a magic 128 + q (bf16 0x4300) or 1024 + q (fp16 0x6400) would
lose about 3 or 6 more. Emulated in float64 against float32 at K = 14336, group 128, 16 bf16 rows,
the result is off by about 1e-6 of the largest output (128 + q: a few times more), against bf16's
rounding of 2e-3; the tests hold it to de-quantise-then-matmul at the float32 kernels' tolerance.
fp32 activations run the same bfloat16 v widened to float32 (exact), with IEEE dots.

The order along K inside each group of eight inputs (one word) is a choice, `ORDER`:
  0  natural: the eight halves are joined back into input order (x is read as stored);
  1  paired: each 32-bit result's two halves stay neighbours (input order 0 4 1 5 2 6 3 7 within
     a word, x permuted to match in registers, or gathered through perm with act-order), so the
     tile reaches the tensor cores with fewer 16-bit moves between registers;
  2  eight dots: one dot per nibble position over the BLOCK_K / 8 words, x read at stride 8
     (needs BLOCK_K >= 128, a dot's smallest K being 16).
`SWAP` computes the transposed product (weights as the dot's left operand, BLOCK_N of them, x
on the right): with BLOCK_N >= 64 that is one warpgroup MMA on Hopper, with the weights taken
from registers, where x as the left operand has only M <= 16 rows. The defaults (swap, order 0,
asm, S by a reduction, BLOCK_N 64, 4 warps, 3 stages) are the variant that
benchmarks/bench_int4_gpu.py --sweep timed fastest on an H100 at every Llama-3-8B projection shape
(order 1 and S on the tensor cores have fewer instructions a weight in the compiled loop, but
were not faster: the kernel is bound by each step's latency, not by its instructions).

Grid (cdiv(N, BLOCK_N), split, 1); each program walks k_len = K / split inputs in BLOCK_K steps
(BLOCK_K divides the group size). With split > 1 the programs write float32 partials
(split, M, N) that one more launch (`splits.sum_splits`) adds up and rounds to the output's dtype. Act-order weights (perm) read x's columns through perm;
8-bit weights keep `decode.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpilot.kernels.host import INTERPRETING, cdiv
from kvpilot.kernels.int_gemm.layout import IntWeight

BLOCK_M = 16  # the dot's smallest side; rows past M are masked
MAX_M = BLOCK_M
ORDERS = (0, 1, 2)


@dataclass(frozen=True)
class Int4DecodeConfig:
    block_n: int = 64  # output features per program
    block_k: int = 128  # inputs per step (at most the group size; the launcher halves it to fit)
    split_k: int = 1  # slices of K, each its own program (a runtime argument: no recompile)
    num_warps: int = 4
    num_stages: int = 3  # steps in flight: each program streams BLOCK_N * BLOCK_K / 2 bytes a step
    order: int = 0  # the order along K inside a word (module docstring)
    swap: bool = True  # weights as the dot's left operand
    asm: bool = True  # one inline-PTX LOP3 for the AND and the OR (GPU only)
    sum_dot: bool = False  # the rows' sums of x on the tensor cores (x @ 1), else a reduction

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order}")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 16, got {self.block_k}")
        if self.order == 2 and self.block_k < 128:
            raise ValueError(f"order 2 (eight dots) needs block_k >= 128, got {self.block_k}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


@triton.jit
def _lead(words, S: tl.constexpr, FP16: tl.constexpr):
    """Nibbles S and S + 4 of each word moved to the top four mantissa bits of the word's low and
    high 16-bit halves (bits 3..6 and 19..22 for bfloat16, 6..9 and 22..25 for fp16). Arithmetic
    right shifts copy the sign bit only into bits the mask then drops."""
    if FP16:
        if S == 0:
            v = words << 6
        elif S == 1:
            v = words << 2
        elif S == 2:
            v = words >> 2
        else:
            v = words >> 6
    else:
        if S == 0:
            v = words << 3
        elif S == 1:
            v = words >> 1
        elif S == 2:
            v = words >> 5
        else:
            v = words >> 9
    return v


@triton.jit
def _halves(words, S: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr):
    """(lo, hi): 1 + q / 16 for nibbles S and S + 4 of each word, as 16-bit floats."""
    v = _lead(words, S, FP16)
    if ASM:  # one LOP3 for the AND and the OR (ptxas keeps them apart)
        if FP16:
            v = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x03C003C0, 0x3C003C00, 0xEA;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            v = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00780078, 0x3F803F80, 0xEA;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
    elif FP16:
        v = (v & 0x03C003C0) | 0x3C003C00
    else:
        v = (v & 0x00780078) | 0x3F803F80
    lo = v.to(tl.int16)
    hi = (v >> 16).to(tl.int16)
    if FP16:
        return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)
    else:
        return lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True)


@triton.jit
def _weight_tile(words, FP16: tl.constexpr, ASM: tl.constexpr, ORDER: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N, BLOCK_K // 8) words -> (BLOCK_N, BLOCK_K) of 1 + q / 16 in ORDER's K order.
    Nested joins (BLOCK_N, W, 2, 2, 2): the first join's axis is the slowest of the three, so
    element 8 j + 4 a + 2 b + c comes from pair a of pair b of half c."""
    lo0, hi0 = _halves(words, 0, FP16, ASM)
    lo1, hi1 = _halves(words, 1, FP16, ASM)
    lo2, hi2 = _halves(words, 2, FP16, ASM)
    lo3, hi3 = _halves(words, 3, FP16, ASM)
    if ORDER == 0:  # position 4a + 2b + c holds nibble 4a + 2b + c
        t = tl.join(tl.join(tl.join(lo0, hi0), tl.join(lo2, hi2)), tl.join(tl.join(lo1, hi1), tl.join(lo3, hi3)))
    else:  # position 4a + 2b + c holds nibble 2a + b + 4c
        t = tl.join(tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3)), tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3)))
    return tl.reshape(t, (BLOCK_N, BLOCK_K))


@triton.jit
def _load_x(x_ptr, perm_ptr, offs_m, mask_m, cols, stride_xm, HAS_PERM: tl.constexpr, WIDEN: tl.constexpr):
    """x[offs_m, cols] (packed columns; through perm with act-order), in float32 if WIDEN."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask_m[:, None], other=0.0)
    if WIDEN:
        x = x.to(tl.float32)
    return x


@triton.jit
def _accumulate(x, v, d, sx, SWAP: tl.constexpr, IEEE: tl.constexpr, SUM_DOT: tl.constexpr):
    """d += x @ v^T (its transpose with SWAP), float32; sx += the rows' sums of x, as x @ 1 on
    the tensor cores (the sums repeated in d's shape) with SUM_DOT, else by a reduction (BLOCK_M,)."""
    v = v.to(x.dtype)
    if SWAP:
        if IEEE:
            d = tl.dot(v, tl.trans(x), d, input_precision="ieee")
        else:
            d = tl.dot(v, tl.trans(x), d)
    else:
        if IEEE:
            d = tl.dot(x, tl.trans(v), d, input_precision="ieee")
        else:
            d = tl.dot(x, tl.trans(v), d)
    if SUM_DOT:
        if SWAP:
            ones = tl.full(v.shape, 1.0, tl.float32).to(x.dtype)
            if IEEE:
                sx = tl.dot(ones, tl.trans(x), sx, input_precision="ieee")
            else:
                sx = tl.dot(ones, tl.trans(x), sx)
        else:
            ones = tl.full((v.shape[1], v.shape[0]), 1.0, tl.float32).to(x.dtype)
            if IEEE:
                sx = tl.dot(x, ones, sx, input_precision="ieee")
            else:
                sx = tl.dot(x, ones, sx)
    else:
        sx += tl.sum(x.to(tl.float32), axis=1)
    return d, sx


@triton.jit(do_not_specialize=["M"])  # M varies from step to step: one compile for all
def _int4_decode_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, M, N, k_len,
                        stride_xm, stride_qn, stride_sg, stride_os, stride_om,
                        GROUP: tl.constexpr, HAS_PERM: tl.constexpr, FP16: tl.constexpr, IEEE: tl.constexpr,
                        WIDEN: tl.constexpr,
                        ORDER: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr, SUM_DOT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    WORDS: tl.constexpr = BLOCK_K // 8
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(pid_s * k_len, (pid_s + 1) * k_len, BLOCK_K):
        offs_w = k0 // 8 + tl.arange(0, WORDS)
        words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_w[None, :], mask=mask_n[:, None], other=0)
        if SWAP:
            d = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        else:
            d = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if not SUM_DOT:
            sx = tl.zeros((BLOCK_M,), tl.float32)
        elif SWAP:
            sx = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        else:
            sx = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if ORDER == 2:
            for shift in tl.static_range(4):
                lo, hi = _halves(words, shift, FP16, ASM)
                cols = k0 + 8 * tl.arange(0, WORDS) + shift
                x_lo = _load_x(x_ptr, perm_ptr, offs_m, mask_m, cols, stride_xm, HAS_PERM, WIDEN)
                d, sx = _accumulate(x_lo, lo, d, sx, SWAP, IEEE, SUM_DOT)
                x_hi = _load_x(x_ptr, perm_ptr, offs_m, mask_m, cols + 4, stride_xm, HAS_PERM, WIDEN)
                d, sx = _accumulate(x_hi, hi, d, sx, SWAP, IEEE, SUM_DOT)
        else:
            p = tl.arange(0, BLOCK_K)
            if ORDER == 1 and HAS_PERM:
                x = _load_x(x_ptr, perm_ptr, offs_m, mask_m, k0 + p - p % 8 + (p % 8 >> 1) + 4 * (p & 1), stride_xm,
                            HAS_PERM, WIDEN)
            else:
                x = _load_x(x_ptr, perm_ptr, offs_m, mask_m, k0 + p, stride_xm, HAS_PERM, WIDEN)
                if ORDER == 1:  # input 4a' + 2b' + c' of each word to position 4b' + 2c' + a'
                    x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, WORDS, 2, 2, 2)), (0, 1, 3, 4, 2)),
                                   (BLOCK_M, BLOCK_K))
            d, sx = _accumulate(x, _weight_tile(words, FP16, ASM, ORDER, BLOCK_N, BLOCK_K), d, sx, SWAP, IEEE, SUM_DOT)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        # Sum x (q - z) = 16 Sum x v - (16 + z) Sum x, scaled per output
        if not SUM_DOT:
            if SWAP:
                acc += s[:, None] * (16.0 * d - (16.0 + z)[:, None] * sx[None, :])
            else:
                acc += s[None, :] * (16.0 * d - (16.0 + z)[None, :] * sx[:, None])
        elif SWAP:
            acc += s[:, None] * (16.0 * d - (16.0 + z)[:, None] * sx)
        else:
            acc += s[None, :] * (16.0 * d - (16.0 + z)[None, :] * sx)
    if SWAP:
        out_ptrs = out_ptr + pid_s * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
    else:
        out_ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def launch(x: torch.Tensor, w: IntWeight, out: torch.Tensor, config: Int4DecodeConfig, block_k: int) -> None:
    """Checked by the launcher: 4-bit weights, M <= MAX_M, split_k * block_k divides K, and out is
    (M, N) in x's dtype or (split_k, M, N) float32 partials."""
    m, k = x.shape
    n = w.out_features
    perm = w.perm if w.perm is not None else w.qweight  # any pointer: unread without act-order
    stride_os = out.stride(0) if config.split_k > 1 else 0
    # the interpreter holds bfloat16 as raw 16-bit integers and its dot multiplies those: it runs
    # bf16 activations' dots in float32 (both operands widen exactly), the unpacking unchanged
    widen = INTERPRETING and x.dtype == torch.bfloat16
    grid = (cdiv(n, config.block_n), config.split_k, 1)
    _int4_decode_kernel[grid](
        x, w.qweight, w.scales, w.zeros, perm, out, m, n, k // config.split_k,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), stride_os, out.stride(-2),
        GROUP=w.group_size, HAS_PERM=w.perm is not None, FP16=x.dtype == torch.float16,
        IEEE=x.dtype == torch.float32 or widen, WIDEN=widen, ORDER=config.order, SWAP=config.swap, SUM_DOT=config.sum_dot, ASM=config.asm and not INTERPRETING,
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=block_k, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
