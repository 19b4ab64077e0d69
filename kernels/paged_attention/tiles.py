"""Online softmax over K/V tiles gathered through a block table: the device functions the
pointer decode kernel and the prefill kernel share (`pointer_decode.py`, `prefill.py`).

A tile is BLOCK_N context positions n; position n lives in cache block table[n // BLOCK_SIZE]
at slot n % BLOCK_SIZE, so one tile spans several blocks when BLOCK_SIZE < BLOCK_N. Pointers
into a cache are `base + block * stride_b + slot * stride_s + d` with `base` already offset to
one KV head (`kvh * stride_h`): the callers pass the strides, so token-major and head-major
caches both work, as long as head_dim has unit stride. Scores are kept in base 2 (the caller
folds log2(e) into the scale) so that each exponential is one exp2. FP8 caches are read as they
are stored (each tile widened to q's dtype, exactly): the caller folds k_scale into the score
scale and multiplies the output by v_scale, which de-quantises at no cost per element.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def load_tile(ptrs, row_ok, d_ok, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASK_ROWS: tl.constexpr):
    """(rows, D_PAD) tile; the head-dim mask is compiled in only when head_dim is padded."""
    if MASK_ROWS:
        if HEAD_DIM == D_PAD:
            return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        return tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if HEAD_DIM == D_PAD:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=d_ok[None, :], other=0.0)


@triton.jit
def score_scales(scale_log2, kv_scales_ptr, KV_FP8: tl.constexpr):
    """(the scale of q.k in base 2, the factor of the output): for an FP8 cache, its k_scale
    folded into the first and its v_scale the second, else (scale_log2, 1)."""
    if KV_FP8:
        return scale_log2 * tl.load(kv_scales_ptr), tl.load(kv_scales_ptr + 1)
    return scale_log2, 1.0


@triton.jit
def softmax_update(s, m_i, l_i):
    """Online softmax in base 2 over one tile of scores s (rows, keys): the new row maxima and
    sums, the tile's probabilities p and the factor alpha that rescales what came before."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _attend_tile(
    q, k_ptrs, v_ptrs, load_ok, keep, m_i, l_i, acc, scale_log2, d_ok,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """One K/V tile of online softmax: returns the updated (max, sum, accumulator).
    MASKED loads only the rows in load_ok and scores only the (row, key) pairs in keep."""
    k = load_tile(k_ptrs, load_ok, d_ok, HEAD_DIM, D_PAD, MASKED).to(q.dtype)  # (BLOCK_N, D_PAD)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (rows, BLOCK_N)
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new, l_i, p, alpha = softmax_update(s, m_i, l_i)
    v = load_tile(v_ptrs, load_ok, d_ok, HEAD_DIM, D_PAD, MASKED).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


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
def attend_keys(
    q, k_base, v_base, table, lo, full_hi, hi, pos, scale_log2, d, d_ok,
    stride_kb, stride_ks, stride_vb, stride_vs,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Online softmax of q's ROWS rows over keys [lo, hi): [lo, full_hi) (whole tiles every row
    sees entirely) with no masks at all, then [full_hi, hi) with row r seeing keys <= pos[r].
    `table` points at the sequence's row of the block table. Returns the rows' (max, sum,
    unnormalised output).

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
