"""Paged attention for a varlen batch that mixes decode, prefill and chunked prefill.

Layouts are those of `reference.py`: q/out (num_tokens, num_heads, head_dim); k_cache/v_cache
(num_blocks, block_size, num_kv_heads, head_dim) with unit stride in head_dim (other strides are
passed to the kernels); block_tables (num_seqs, max_blocks) int32; seq_lens (num_seqs,) int32;
query_start_loc (num_seqs + 1,) int32. A sequence's query rows are its last q_len positions.

Three kernels share the work, with no host synchronisation:
* `_decode_kernel`, grid (num_kv_heads, num_seqs, num_splits): one program per sequence and KV
  head packs the GQA group's query heads into the rows of one tile, so each K/V tile is read
  once for the whole group ("GQA packing"). It walks the context in tiles of BLOCK_N tokens
  gathered from several blocks (block ids looked up per token), online softmax in base 2. With
  num_splits > 1 each program takes one slice of the context ("split-KV", flash-decoding) and
  writes a partial output and its log-sum-exp; `_reduce_kernel` merges the slices.
* `_prefill_kernel`, grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads): flash-attention
  tiles with tl.dot. A tile's BLOCK_M rows are BLOCK_Q query tokens x the GQA group's heads
  (row m -> token m // GROUP, head m % GROUP), so K/V tiles are shared by the group here too.
  Sequence i owns the program ids starting at qsl[i] // BLOCK_Q + i (an upper bound on the tiles
  it needs, found by binary search), so the grid is known from shapes alone.
* `_decode_tma_kernel`, grid (num_kv_heads, num_seqs), where use_tma asks for it (the engine's
  decode CUDA graphs do): on Hopper and later, single-token decode over unsplit contexts when the
  caller passes max_query_len, in place of `_decode_kernel`: the same GQA packing, one cache block
  per step fetched by TMA (one bulk copy per (block, KV head) run of a head-major cache), block
  ids loaded a chunk at a time (see the kernel). On an H200, replayed from CUDA graphs, it ran
  0.3-0.8% faster than `_decode_kernel` at block 16 and 1.1-1.6% at block 32 on 2048-token
  contexts (calls at bd99605 and a1dfb22), 8% faster at block 32 on ragged ones (TMA_DEFAULTS,
  benchmarks/RESULTS.md); its eager launch costs more host time (see the kernel), so eager
  launches keep `_decode_kernel`.
A decode kernel takes the sequences with q_len == 1 and the prefill kernel those with more.
Without a sync the launcher cannot tell an all-decode batch from one with as many tokens as
sequences where some are empty and others long; when the caller passes max_query_len (the engine
does) it knows. When it does not and num_tokens == num_seqs, only the decode kernel runs, built
with MULTI: a program loops over every query token of its sequence, so any q_len stays correct
(the loop changes the code Triton generates for the single-token path too, so each variant has
its own default tiles: see DecodeConfig).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kvpilot.kernels.checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from kvpilot.kernels.host import cdiv, next_power_of_2
from kvpilot.kernels.ops import tma_switch

LOG2E = 1.4426950408889634
MAX_GROUP = 16
MAX_HEAD_DIM = 128


# Defaults picked on an H200 by `benchmarks/bench_kernels.py --sweep` and scratch sweeps of the same
# case (see benchmarks/RESULTS.md). Decode B=64 x 2048, block 16, the single-token kernel (the
# engine passes max_query_len), in the sweep at 9ea48be: (64, 2, 2) 0.1353 ms, (64, 4, 2) 0.1358,
# (128, 4, 2) 0.1550, SDPA on contiguous KV 0.1348 in the same run. The MULTI kernel (no
# max_query_len) compiles differently: (128, 4, 2) 0.139 ms but (64, 4, 2) 0.148, hence its own
# default. What decides it is how many programs fit per SM, set by registers and shared memory
# (`benchmarks/compile_probe.py`). Loading
# block ids a tile ahead (prefetch) changes nothing measurable in decode (32-token tiles, 2 warps,
# 3 stages: 0.1352 ms) but lets prefill keep 2 K/V buffers in flight: 8 x 1024 prefill 0.2646 ms
# with (64, 64, 4, 3) + prefetch against 0.2861 without (SDPA flash 0.2772), chunked prefill 0.7968
# against 0.8887 (SDPA 0.8998); (128, 128, 8, 3) + prefetch is faster on chunked prefill only
# (0.7670) and slower on prefill (0.3017), so one default covers both.
@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64  # context tokens per K/V tile (several cache blocks when block_size < it)
    num_warps: int = 2
    num_stages: int = 2
    prefetch: bool = False  # block ids one tile ahead (see _attend_keys)


MULTI_DECODE = DecodeConfig(block_n=128, num_warps=4, num_stages=2)


# The TMA decode kernel (Hopper and later, see _decode_tma_kernel), one config per block size it
# reads. Picked on an H200 with `benchmarks/bench_kernels.py --tma-sweep` at bd99605, each kernel
# replayed from a CUDA graph with L2 flushed (as the engine's decode graphs run it), 3 rounds, B=64,
# 32/8 heads, hd 128, bf16, (chunk, warps, stages):
#   block 16, contexts 2048: (64, 1, 4) 0.1375-0.1376 ms, (64, 1, 3) 0.1368-0.1372, (128, 1, 3)
#     0.1369-0.1371, (32, 1, 3) 0.1375-0.1376; pointer kernel 0.1380, SDPA (contiguous) 0.1371;
#   block 16, contexts 200..2048: (64, 1, 4) 0.0967-0.0970, (32, 1, 4) 0.0981-0.0983, (128, 1, 3)
#     0.0994-0.0997, (64, 1, 3) 0.0998-0.1000, (32, 1, 3) 0.1007-0.1010; pointer 0.0970-0.0976.
#     Ragged batches leave the longest sequences streaming alone at the end, where a program's
#     bytes in flight (stages x 8 KiB at block 16) set the pace: hence 4 stages;
#   block 32, contexts 2048: (64, 1, 3) 0.1361-0.1362, (32, 1, 3) 0.1360-0.1362, (64, 1, 4) 0.1371-
#     0.1373; pointer 0.1376-0.1377, SDPA 0.1370-0.1373; contexts 200..2048: (64, 1, 3) 0.0906-0.0907,
#     (32, 1, 3) 0.0903-0.0905, (64, 1, 4) 0.0919-0.0923; pointer 0.0982-0.0985.
# 2 warps ran 0.1409-0.1412 at block 16 (8f1c545). At block 64 the kernel ran 0.1424 against the
# pointer kernel's 0.1352 (exp_decode_paging.py at b7787f3), so 64-token blocks stay on the latter.
@dataclass(frozen=True)
class TmaDecodeConfig:
    chunk: int = 64  # block ids loaded per vector load
    num_warps: int = 1
    num_stages: int = 3


TMA_DEFAULTS = {16: TmaDecodeConfig(num_stages=4), 32: TmaDecodeConfig()}
TMA_BLOCK_SIZES = tuple(TMA_DEFAULTS)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 64  # query rows per tile: (block_m // group) tokens x group heads
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = True  # as in DecodeConfig


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _load_tile(ptrs, row_ok, d_ok, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASK_ROWS: tl.constexpr):
    """(rows, D_PAD) tile; the head-dim mask is compiled in only when head_dim is padded."""
    if MASK_ROWS:
        if HEAD_DIM == D_PAD:
            return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        return tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if HEAD_DIM == D_PAD:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=d_ok[None, :], other=0.0)


@triton.jit
def _attend_tile(
    q, k_ptrs, v_ptrs, load_ok, keep, m_i, l_i, acc, scale_log2, d_ok,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """One K/V tile of online softmax in base 2: returns the updated (max, sum, accumulator).
    MASKED loads only the rows in load_ok and scores only the (row, key) pairs in keep."""
    k = _load_tile(k_ptrs, load_ok, d_ok, HEAD_DIM, D_PAD, MASKED)  # (BLOCK_N, D_PAD)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (rows, BLOCK_N)
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new, l_i, p, alpha = _softmax_update(s, m_i, l_i)
    v = _load_tile(v_ptrs, load_ok, d_ok, HEAD_DIM, D_PAD, MASKED)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _softmax_update(s, m_i, l_i):
    """Online softmax in base 2 over one tile of scores s (rows, keys): the new row maxima and
    sums, the tile's probabilities p and the factor alpha that rescales what came before."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _block_ids(table, n, n_ok, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The cache block holding each context position n (0 where n_ok is false, when MASKED)."""
    if MASKED:
        return tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0)
    return tl.load(table + n // BLOCK_SIZE)


@triton.jit
def _tile_ptrs(k_base, v_base, block, n, d, stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_SIZE: tl.constexpr):
    """K and V tile pointers of context positions n, which lie in cache blocks `block`."""
    block = block.to(tl.int64)
    slot = n % BLOCK_SIZE
    k_ptrs = k_base + (block * stride_kb + slot * stride_ks)[:, None] + d[None, :]
    v_ptrs = v_base + (block * stride_vb + slot * stride_vs)[:, None] + d[None, :]
    return k_ptrs, v_ptrs


@triton.jit
def _attend_keys(
    q, k_base, v_base, table, lo, full_hi, hi, pos, scale_log2, d, d_ok,
    stride_kb, stride_ks, stride_vb, stride_vs,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Online softmax of q's ROWS rows over keys [lo, hi): [lo, full_hi) (whole tiles every row
    sees entirely) with no masks at all, then [full_hi, hi) with row r seeing keys <= pos[r].
    Returns the rows' (max, sum, unnormalised output).

    PREFETCH loads the whole tiles' block ids one iteration ahead. Without it, each tile's K/V
    loads depend on a load in their own iteration, and Triton's pipeliner gives K and V one
    shared-memory buffer each at any num_stages (seen in the TTGIR compiled for sm_90): a program
    waits for its tile, computes, then issues the next loads. With it, the K/V addresses come
    from the previous iteration, which lets the pipeliner overlap them with the compute."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH:
        block = _block_ids(table, lo + offs_n, lo + offs_n < full_hi, BLOCK_SIZE, True)
    for start in range(lo, full_hi, BLOCK_N):
        n = start + offs_n
        if not PREFETCH:
            block = _block_ids(table, n, n, BLOCK_SIZE, False)
        k_ptrs, v_ptrs = _tile_ptrs(k_base, v_base, block, n, d, stride_kb, stride_ks, stride_vb,
                                    stride_vs, BLOCK_SIZE)
        if PREFETCH:
            block = _block_ids(table, n + BLOCK_N, n + BLOCK_N < full_hi, BLOCK_SIZE, True)
        m_i, l_i, acc = _attend_tile(q, k_ptrs, v_ptrs, n, n, m_i, l_i, acc, scale_log2, d_ok,
                                     HEAD_DIM, D_PAD, False, PRECISION)
    for start in range(full_hi, hi, BLOCK_N):
        n = start + offs_n
        n_ok = n < hi
        block = _block_ids(table, n, n_ok, BLOCK_SIZE, True)
        k_ptrs, v_ptrs = _tile_ptrs(k_base, v_base, block, n, d, stride_kb, stride_ks, stride_vb,
                                    stride_vs, BLOCK_SIZE)
        m_i, l_i, acc = _attend_tile(q, k_ptrs, v_ptrs, n_ok, n[None, :] <= pos[:, None], m_i, l_i, acc,
                                     scale_log2, d_ok, HEAD_DIM, D_PAD, True, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _decode_token(
    out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_base, v_base, table, tok, kv_len, split,
    split_size, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_vb, stride_vs, stride_pt, stride_ph, stride_ps,
    heads, row_ok, d, d_ok,
    M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Attention of one query token (its GQA group's heads as rows) over keys [lo, hi) of its
    slice of the context: full tiles unmasked, then the masked tail."""
    lo = split * split_size
    hi = tl.minimum(lo + split_size, kv_len)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    q = _load_tile(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
                   row_ok, d_ok, HEAD_DIM, D_PAD, True)  # (M, D_PAD)
    pos = tl.zeros([M], tl.int32) + (hi - 1)  # every row (head) sees the whole slice
    m_i, l_i, acc = _attend_keys(q, k_base, v_base, table, lo, full_hi, hi, pos, scale_log2, d, d_ok,
                                 stride_kb, stride_ks, stride_vb, stride_vs, M, HEAD_DIM, D_PAD,
                                 BLOCK_SIZE, BLOCK_N, PRECISION, PREFETCH)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SPLIT:
        part = tok * stride_pt + heads * stride_ph + split * stride_ps  # (M,)
        tl.store(part_out_ptr + part[:, None] + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        lse = m_i + tl.log2(l_safe)  # -inf for an empty slice
        # part_lse is part_out without its D_PAD axis, so its offset is part // D_PAD
        tl.store(part_lse_ptr + part // D_PAD, lse, mask=row_ok)
    else:
        tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, split_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pt, stride_ph, stride_ps,
    GROUP: tl.constexpr, M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, MULTI: tl.constexpr,
    PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    # KV head fastest: programs side by side share a sequence's cache rows (measured within noise
    # of sequence-fastest order at fae0681, 0.1491 against 0.1500 ms; kept)
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    ctx = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, M)
    row_ok = rows < GROUP
    heads = kvh * GROUP + rows
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    if q_end - q_start == 1:
        # the decode case, kept out of any outer loop: nested in the token loop below, the tile
        # loop ran 0.147 ms instead of 0.138 (B=64 x 2048, block 16, H200)
        _decode_token(out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_base, v_base, table, q_start,
                      ctx, split, split_size, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_kb, stride_ks, stride_vb, stride_vs, stride_pt, stride_ph, stride_ps,
                      heads, row_ok, d, d_ok, M, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, SPLIT, PRECISION, PREFETCH)
    elif MULTI:
        # an all-decode-sized batch that may hold empty sequences: this program takes every query
        # token of its sequence; token tok sits at context position ctx - (q_end - tok)
        for tok in range(q_start, q_end):
            _decode_token(out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_base, v_base, table, tok,
                          ctx - q_end + tok + 1, split, split_size, scale_log2, stride_qt, stride_qh,
                          stride_ot, stride_oh, stride_kb, stride_ks, stride_vb, stride_vs,
                          stride_pt, stride_ph, stride_ps, heads, row_ok, d, d_ok,
                          M, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, SPLIT, PRECISION, PREFETCH)


@triton.jit
def _reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, qsl_ptr,
    handle_multi, split_size, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Merge the split-KV partial outputs of one (sequence, query head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    if (handle_multi == 0) & (q_end - q_start != 1):
        return
    ctx = tl.load(seq_lens_ptr + seq)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    for tok in range(q_start, q_end):
        kv_len = ctx - q_end + tok + 1
        s_ok = s < tl.cdiv(kv_len, split_size)
        part = tok * stride_pt + head * stride_ph + s * stride_ps  # (SPLITS_PAD,)
        lse = tl.load(part_lse_ptr + part // D_PAD, mask=s_ok, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))
        w = tl.where(s_ok, w, 0.0)
        o = tl.load(part_out_ptr + part[:, None] + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + d,
                 o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _attend_block(
    q, k_desc, v_desc, blk, kvh, key_ok, m_i, l_i, acc, scale_log2,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """One cache block of online softmax, K and V fetched as one TMA box each (the block's run
    for KV head kvh in a head-major cache). MASKED scores only the keys in key_ok and zeroes the
    other value rows (slots past the context may hold anything, NaN included)."""
    k = k_desc.load([blk, kvh, 0, 0]).reshape(BLOCK_SIZE, HEAD_DIM)
    v = v_desc.load([blk, kvh, 0, 0]).reshape(BLOCK_SIZE, HEAD_DIM)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if MASKED:
        s = tl.where(key_ok[None, :], s, float("-inf"))
        v = tl.where(key_ok[:, None], v, 0.0)
    m_new, l_i, p, alpha = _softmax_update(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_tma_kernel(
    out_ptr, q_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr, qsl_ptr, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr,
):
    """Single-token decode through TMA, grid (num_kv_heads, num_seqs): one program per (sequence,
    KV head) with the GQA group's query heads as rows, one cache block per step. Sequences whose
    q_len is not 1 are left to the other kernels.

    The block ids come CHUNK at a time in one vector load and are picked out of registers, so no
    TMA coordinate waits on a load of the step before it: the pipeliner then streams the boxes
    num_stages deep. With each id loaded a step ahead instead, the same reads without the math
    streamed 3% slower than TMA reads of contiguous KV (benchmarks/RESULTS.md). The full blocks go
    by chunks (the last one partial, its ids loaded masked), then the partly filled last block, if
    any, with its keys masked.

    Host cost: every launch has Triton's launcher encode two CUtensorMaps from the host
    TensorDescriptors. An eager launch through paged_attention_with took 83-151 µs of host time
    on the H200's host against 50-94 µs for the pointer kernel and 16-30 µs for SDPA (bench_kernels,
    three calls), more than the device time it saves; under a CUDA graph it is paid once, at
    capture."""
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    tok = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - tok != 1:
        return
    ctx = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, M)
    row_ok = rows < GROUP
    heads = kvh * GROUP + rows
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    keys = tl.arange(0, BLOCK_SIZE)
    c = tl.arange(0, CHUNK)
    full = ctx // BLOCK_SIZE  # blocks holding BLOCK_SIZE tokens: no key mask
    for c0 in range(0, full, CHUNK):
        ids = tl.load(table + c0 + c, mask=c0 + c < full, other=0)
        for j in range(0, tl.minimum(CHUNK, full - c0)):
            blk = tl.sum(tl.where(c == j, ids, 0))  # element j, from registers
            m_i, l_i, acc = _attend_block(q, k_desc, v_desc, blk, kvh, keys, m_i, l_i, acc, scale_log2,
                                          BLOCK_SIZE, HEAD_DIM, False, PRECISION)
    for b in range(full, tl.cdiv(ctx, BLOCK_SIZE)):  # the partly filled last block, if any: masked
        m_i, l_i, acc = _attend_block(q, k_desc, v_desc, tl.load(table + b), kvh, b * BLOCK_SIZE + keys < ctx,
                                      m_i, l_i, acc, scale_log2, BLOCK_SIZE, HEAD_DIM, True, PRECISION)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # the sequence owning this tile: the largest i with qsl[i] // BLOCK_Q + i <= pid
    lo = num_seqs * 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= pid, mid, lo)
        hi = tl.where(first <= pid, hi, mid)
    seq = lo
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q0 = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query token of this tile
    if (q_len <= 1) | (q0 >= q_len):
        return
    ctx = tl.load(seq_lens_ptr + seq)
    offs_m = tl.arange(0, BLOCK_M)
    tok = q0 + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx - q_len + tok  # context position of each row's query
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = _load_tile(q_ptr + (q_rows * stride_qt + heads * stride_qh)[:, None] + d[None, :],
                   row_ok, d_ok, HEAD_DIM, D_PAD, True)  # (BLOCK_M, D_PAD)
    first_pos = ctx - q_len + q0
    hi_n = ctx - q_len + tl.minimum(q0 + BLOCK_Q, q_len)  # keys past the tile's last query: masked
    full_n = (first_pos + 1) // BLOCK_N * BLOCK_N  # tiles every row of this tile sees entirely
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    _, l_i, acc = _attend_keys(q, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, table, 0, full_n, hi_n,
                               pos, scale_log2, d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs,
                               BLOCK_M, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, PRECISION, PREFETCH)
    o = acc / l_i[:, None]
    tl.store(out_ptr + (q_rows * stride_ot + heads * stride_oh)[:, None] + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split the context only when the (sequence, KV head) programs cannot fill the chip."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    programs = num_seqs * num_kv_heads
    if programs >= 2 * sms:
        return 1
    # at most one wave of two programs per SM: on an H200, B=4 x 32k (32 programs unsplit) ran
    # 0.150 ms with 8 slices (256 programs) but 0.203 ms with 9 (288: a second, nearly empty wave)
    by_occupancy = max(1, (2 * sms) // programs)
    by_length = cdiv(max_context, 512)  # keep each slice long enough to stream
    return max(1, min(by_occupancy, by_length, 64))


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
) -> None:
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES, q.device)
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES, q.device)
    check_same_dtype("k_cache", k_cache, "q", q)
    check_same_dtype("v_cache", v_cache, "q", q)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache head_dim {cache_head_dim} differs from q head_dim {head_dim}")
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 up to {MAX_HEAD_DIM}, got {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of 2, got {block_size}")
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}) at most {MAX_GROUP} times larger")
    check_tensor("block_tables", block_tables, 2, (torch.int32,), q.device)
    num_seqs = block_tables.shape[0]
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), q.device)
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,), q.device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_contiguous("seq_lens", seq_lens)
    check_contiguous("query_start_loc", query_start_loc)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int | None = None,
    *, in_graph: bool = False,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.
    `max_query_len` (the longest sequence's new tokens, known to the caller without a sync) lets
    an all-decode batch run the decode kernel built for one token per sequence.
    `in_graph` says the launch is being recorded into a CUDA graph (triton_graph_ops): there the
    TMA decode kernel runs wherever it can read the caches (`tma_decode_unsupported`), since a
    replay skips the host work that makes its launch dearer than the pointer kernel's. The
    KVPILOT_DECODE_TMA switch overrides that: `1` takes the TMA kernel in eager launches too,
    `0` never takes it, `graphs` (the default) as above."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if max_query_len is not None and not 0 <= max_query_len <= q.shape[0]:
        raise ValueError(f"max_query_len must be between 0 and num_tokens ({q.shape[0]}), got {max_query_len}")
    switch = tma_switch()
    wants_tma = switch == "1" or (in_graph and switch == "graphs")
    return paged_attention_with(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                max_query_len=max_query_len, use_tma=None if wants_tma else False)


def tma_decode_unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why the TMA decode kernel cannot read these caches, or None when it can: it needs a
    Hopper or later GPU (or Triton's interpreter), head-major caches (each (block, KV head) one
    contiguous run, as the GPU engine allocates), 16- or 32-token blocks (the measured ones; the
    pointer kernel is faster at 64, and a tl.dot needs 16 keys), a power-of-two head dim (a box is
    one tensor) and 16-byte aligned bases."""
    if q.device.type == "cuda" and not _interpreting() and torch.cuda.get_device_capability(q.device)[0] < 9:
        return "TMA needs a Hopper or later GPU (compute capability 9.0)"
    _, block_size, _, head_dim = k_cache.shape
    if block_size not in TMA_BLOCK_SIZES:
        return f"block_size {block_size} is not one of {TMA_BLOCK_SIZES}"
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} is not a power of two >= 16"
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.transpose(1, 2).is_contiguous():
            return f"{name} is not head-major (strides {tuple(cache.stride())})"
        if cache.data_ptr() % 16:
            return f"{name} does not start on a 16-byte boundary"
    return None


def _decode_tma(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale_log2: float, precision: str,
    tma: TmaDecodeConfig,
) -> None:
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    descs = [TensorDescriptor.from_tensor(c.transpose(1, 2), [1, 1, block_size, head_dim]) for c in (k_cache, v_cache)]
    _decode_tma_kernel[(num_kv_heads, block_tables.shape[0])](
        out, q, *descs, block_tables, seq_lens, query_start_loc, scale_log2,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, M=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        CHUNK=tma.chunk, PRECISION=precision, num_warps=tma.num_warps, num_stages=tma.num_stages,
    )


def _decode_pointers(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale_log2: float, precision: str,
    decode: DecodeConfig, num_splits: int, split_size: int, multi: bool, d_pad: int,
    cache_strides: tuple[int, ...],
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    if num_splits > 1:
        part_out = torch.empty((num_tokens, num_heads, num_splits, d_pad), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32,
                               device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        out, part_out, part_lse, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        scale_log2, split_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides,
        num_heads * num_splits * d_pad, num_splits * d_pad, d_pad,
        GROUP=group, M=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=decode.block_n, SPLIT=num_splits > 1, MULTI=multi,
        PRECISION=precision, PREFETCH=decode.prefetch,
        num_warps=decode.num_warps, num_stages=decode.num_stages,
    )
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, seq_lens, query_start_loc, int(multi), split_size,
            out.stride(0), out.stride(1), num_heads * num_splits * d_pad, num_splits * d_pad, d_pad,
            HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_PAD=next_power_of_2(num_splits),
            num_warps=4,
        )


def paged_attention_with(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
    max_query_len: int | None = None, num_splits: int | None = None, decode: DecodeConfig | None = None,
    prefill: PrefillConfig | None = None, out: torch.Tensor | None = None,
    use_tma: bool | None = False, tma: TmaDecodeConfig | None = None,
) -> torch.Tensor:
    """`paged_attention` without the argument checks and with the tuning knobs exposed
    (benchmarks and tests pick them, tests pass a poisoned `out`; the engine takes defaults).
    use_tma runs the single-token sequences through _decode_tma_kernel (Hopper or later, caches
    as tma_decode_unsupported says) when max_query_len is given and the context is not split:
    True asks for it (ValueError where it cannot read the caches), None takes it where it can,
    False never does. `tma` defaults to TMA_DEFAULTS for the cache's block size."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    d_pad = max(16, next_power_of_2(head_dim))
    scale_log2 = scale * LOG2E
    # float32 caches get float32 products: Triton's default for a float32 dot is tf32 (~3e-4)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    interp = _interpreting()
    prefill = prefill or (PrefillConfig(block_m=32, block_n=16, num_stages=1) if interp
                          else PrefillConfig())
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0))
    # as many tokens as sequences: all decode, unless some sequence is empty and another has
    # several tokens; without max_query_len to rule that out, the decode kernel covers any q_len
    # (MULTI) and the prefill kernel does not run
    all_decode = num_tokens == num_seqs if max_query_len is None else max_query_len <= 1
    multi = all_decode and max_query_len is None
    if decode is None:
        decode = DecodeConfig(block_n=16, num_stages=1) if interp else MULTI_DECODE if multi else DecodeConfig()
    max_context = block_tables.shape[1] * block_size  # an upper bound known without a sync
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, q.device)
    split_size = cdiv(cdiv(max_context, num_splits), decode.block_n) * decode.block_n
    num_splits = cdiv(max_context, split_size)
    why = "not asked for" if use_tma is False else tma_decode_unsupported(q, k_cache, v_cache)
    if use_tma and why:
        raise ValueError(f"the TMA decode kernel cannot serve these caches: {why}")
    if why is None and not multi and num_splits == 1:
        _decode_tma(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale_log2,
                    precision, tma or TMA_DEFAULTS[block_size])
    else:
        _decode_pointers(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale_log2,
                         precision, decode, num_splits, split_size, multi, d_pad, cache_strides)
    if not all_decode:
        block_q = prefill.block_m // group
        _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
            out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale_log2, num_seqs,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides,
            GROUP=group, BLOCK_M=prefill.block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, D_PAD=d_pad,
            BLOCK_SIZE=block_size, BLOCK_N=prefill.block_n, PRECISION=precision, PREFETCH=prefill.prefetch,
            num_warps=prefill.num_warps, num_stages=prefill.num_stages,
        )
    return out

