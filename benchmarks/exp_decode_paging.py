"""Experiments on the last gap of issue 5: block-16 paged decode against SDPA on contiguous KV.

Not part of the engine. Timed against the shipped decode kernel and SDPA in one process (B=64 x
2048, 32/8 heads, head dim 128, bf16, head-major cache, random block tables):
* `_tma_decode_kernel`: one tensor-descriptor (TMA) load per cache block, i.e. one bulk copy of a
  contiguous head-major run: one KV head (block_size x 256 B), or HP adjacent KV heads with the
  HP x GROUP query heads as the rows of one block-diagonal tile; block ids loaded an iteration
  ahead (IDS_AHEAD) or not.
* the same with SPLITS slices of the context per program (merged by the shipped `_reduce_kernel`),
  so that boxes of several heads keep 512 programs.
* `_read_kernel`: a control, the same TMA reads without the attention math, on random and on
  sequential block tables: how fast the access pattern streams at all; `_read_contiguous_kernel`,
  the same reads of SDPA's contiguous layout; `_chunk_read_kernel`, the reads with block ids
  loaded a chunk at a time, as the shipped `_decode_tma_kernel` (opt-in) loads them.
The figures in benchmarks/RESULTS.md come from the code at the commits named there: the
single-head and several-head TMA kernels were separate then (a29b222 also timed 2 and 4 blocks per
iteration), and d1e0178 holds two ideas dropped since, both slower than the shipped kernel:
several KV heads per program with pointer loads, and an L2 bulk prefetch of the blocks a few
tiles ahead.
Each variant is checked against the reference before it is timed; a variant that fails to
compile or differs is reported and skipped.
    python benchmarks/exp_decode_paging.py [--out DIR] [--control-only | --chunked | --compare]
--control-only: SDPA, the shipped kernel, the split variants and the controls; --chunked: the
shipped TMA kernel's configs and the chunked read control; --compare: the shipped TMA and pointer
kernels and SDPA, interleaved.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kvpilot.kernels import reference
from kvpilot.kernels.paged_attention import (
    LOG2E,
    DecodeConfig,
    TmaDecodeConfig,
    _reduce_kernel,
    paged_attention_with,
)

# bench_kernels.py sits beside this file; PYTHONSAFEPATH (set by the Makefile and run_on_gpu.sh)
# keeps a script's folder off sys.path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import Bench, rel  # noqa: E402


@triton.jit
def _softmax_step(q, k, v, keep, key_ok, m_i, l_i, acc, scale_log2, MASK_SCORES: tl.constexpr,
                  MASK_VALUES: tl.constexpr):
    """One tile of online softmax in base 2: scores only where keep (rows x keys), value rows
    only where key_ok (keys past the context may hold anything, NaN included)."""
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASK_SCORES:
        s = tl.where(keep, s, float("-inf"))
    if MASK_VALUES:
        v = tl.where(key_ok[:, None], v, 0.0)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _load_block(desc, blk, kvh, ROWS: tl.constexpr, D: tl.constexpr):
    """One TMA box of a head-major cache at (block, first KV head), as (ROWS, D)."""
    return desc.load([blk, kvh, 0, 0]).reshape(ROWS, D)


@triton.jit
def _tma_decode_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_desc, v_desc, tables_ptr, seq_lens_ptr, scale_log2,
    split_blocks, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, HP: tl.constexpr,
    IDS_AHEAD: tl.constexpr, SPLITS: tl.constexpr,
):
    """Single-token decode, one TMA box per cache block. The box covers HP adjacent KV heads, whose
    head-major runs are contiguous (HP x block_size x 256 B). Rows are the HP x GROUP query heads
    (GQA packing over several KV heads), columns HP x block_size keys; with HP > 1 a row scores
    only its own KV head's keys, so the product is block-diagonal and costs what the padded
    single-head tile costs. IDS_AHEAD loads the next block's id an iteration early, so the TMA
    loads depend on no load of their own iteration and the pipeliner buffers them num_stages deep
    (without it, fewer buffers than num_stages asks: 25 KiB of shared memory against 46 KiB at 6
    stages, compiled for sm_90). With SPLITS > 1 a program takes split_blocks blocks of the
    context (program id 0 = head group x SPLITS + slice) and writes a partial output and its
    base-2 log-sum-exp in the layout the shipped _reduce_kernel merges: several heads per box
    without shrinking the grid."""
    kvh0 = (tl.program_id(0) // SPLITS) * HP
    part = tl.program_id(0) % SPLITS
    seq = tl.program_id(1)
    ctx = tl.load(seq_lens_ptr + seq)
    lo = part * split_blocks
    hi = tl.minimum(lo + split_blocks, tl.cdiv(ctx, BS))
    if lo >= hi:
        return
    rows = tl.arange(0, M)
    row_ok = rows < HP * GROUP
    heads = kvh0 * GROUP + rows
    d = tl.arange(0, D)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    cols = tl.arange(0, HP * BS)
    own = (rows // GROUP)[:, None] == (cols // BS)[None, :]
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    full = tl.minimum(hi, ctx // BS)  # blocks of this slice the whole context fills
    nxt = tl.load(table + lo, mask=lo < full, other=0)
    for b in range(lo, full):
        if IDS_AHEAD:
            blk = nxt
            nxt = tl.load(table + b + 1, mask=b + 1 < full, other=0)
        else:
            blk = tl.load(table + b)
        k = _load_block(k_desc, blk, kvh0, HP * BS, D)
        v = _load_block(v_desc, blk, kvh0, HP * BS, D)
        m_i, l_i, acc = _softmax_step(q, k, v, own, cols, m_i, l_i, acc, scale_log2, HP > 1, False)
    for b in range(tl.maximum(lo, full), hi):  # the partly filled last block
        blk = tl.load(table + b)
        k = _load_block(k_desc, blk, kvh0, HP * BS, D)
        v = _load_block(v_desc, blk, kvh0, HP * BS, D)
        key_ok = b * BS + cols % BS < ctx
        m_i, l_i, acc = _softmax_step(q, k, v, own & key_ok[None, :], key_ok, m_i, l_i, acc, scale_log2,
                                      True, True)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        at = (seq * (tl.num_programs(0) // SPLITS * HP * GROUP) + heads) * SPLITS + part  # (token, head, slice)
        tl.store(part_lse_ptr + at, m_i + tl.log2(l_i), mask=row_ok)
        tl.store(part_out_ptr + at[:, None] * D + d[None, :], o, mask=row_ok[:, None])


def tma_decode(q, k_cache, v_cache, tables, seq_lens, scale, heads_per_program, warps, stages, ids_ahead,
               splits=1):
    """Single-token decode through TMA boxes of heads_per_program KV heads (head-major caches); with
    splits > 1 each program takes 1 / splits of the longest context and _reduce_kernel merges."""
    num_tokens, num_heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    hp = heads_per_program
    descs = [TensorDescriptor.from_tensor(c.transpose(1, 2), [1, hp, bs, d]) for c in (k_cache, v_cache)]
    out = torch.empty_like(q)
    group = num_heads // kvh
    split_blocks = -(-tables.shape[1] // splits)
    part_out = torch.empty(num_tokens, num_heads, splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    _tma_decode_kernel[(kvh // hp * splits, tables.shape[0])](
        out, part_out, part_lse, q, *descs, tables, seq_lens, scale * LOG2E, split_blocks, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), tables.stride(0), GROUP=group, M=max(16, triton.next_power_of_2(hp * group)),
        D=d, BS=bs, HP=hp, IDS_AHEAD=ids_ahead, SPLITS=splits, num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        qsl = torch.arange(num_tokens + 1, dtype=torch.int32, device=q.device)
        _reduce_kernel[(num_tokens, num_heads)](
            out, part_out, part_lse, seq_lens, qsl, 0, split_blocks * bs, out.stride(0), out.stride(1),
            num_heads * splits * d, splits * d, d, HEAD_DIM=d, D_PAD=d, SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out


@triton.jit
def _read_kernel(out_ptr, k_desc, v_desc, tables_ptr, ctx, stride_bt, D: tl.constexpr, BS: tl.constexpr,
                 HP: tl.constexpr, SPLITS: tl.constexpr):
    """A control with no attention math: the same per-block TMA reads as _tma_decode_kernel (a box of
    HP adjacent KV heads, block ids an iteration ahead), reduced to column sums. How fast can this
    access pattern be streamed at all? SPLITS slices of the context per program keep the grid at
    512 programs when HP > 1 (then a program reads HP x 4 KiB contiguous per block at block 16).
    The sums go through tl.dot with a ones matrix: summed with tl.sum, the tiles compile to one
    shared-memory buffer at any num_stages (loads that feed no tl.dot are not pipelined), and the
    control would measure latency instead."""
    kvh = (tl.program_id(0) // SPLITS) * HP
    part = tl.program_id(0) % SPLITS
    seq = tl.program_id(1)
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    per = ctx // BS // SPLITS
    first = part * per
    nxt = tl.load(table + first)
    acc = tl.zeros([16, D], tl.float32)
    ones = tl.full([16, HP * BS], 1.0, tl.float32).to(k_desc.dtype)
    for b in range(first, first + per):
        blk = nxt
        nxt = tl.load(table + b + 1, mask=b + 1 < first + per, other=0)
        acc = tl.dot(ones, _load_block(k_desc, blk, kvh, HP * BS, D), acc)
        acc = tl.dot(ones, _load_block(v_desc, blk, kvh, HP * BS, D), acc)
    d = tl.arange(0, D)
    tl.store(out_ptr + (seq * tl.num_programs(0) + tl.program_id(0)) * D + d, tl.sum(acc, 0) / 16)


def read_only(k_cache, v_cache, tables, ctx, warps, stages, heads_per_box=1, splits=1):
    """Per (sequence, group of heads_per_box KV heads): the sum over the first ctx positions of K
    and V, (num_seqs, kvh // heads_per_box, d). ctx // block_size must divide by splits."""
    _, bs, kvh, d = k_cache.shape
    hp = heads_per_box
    descs = [TensorDescriptor.from_tensor(c.transpose(1, 2), [1, hp, bs, d]) for c in (k_cache, v_cache)]
    out = torch.empty(tables.shape[0], kvh // hp, splits, d, dtype=torch.float32, device=k_cache.device)
    _read_kernel[(kvh // hp * splits, tables.shape[0])](out, *descs, tables, ctx, tables.stride(0), D=d, BS=bs,
                                                        HP=hp, SPLITS=splits, num_warps=warps, num_stages=stages)
    return out.sum(2)


@triton.jit
def _read_contiguous_kernel(out_ptr, k_desc, v_desc, ctx, D: tl.constexpr, BN: tl.constexpr):
    """The control on SDPA's own layout, (B x KV heads, context, D) contiguous: the same TMA reads
    and tl.dot sums as _read_kernel, BN tokens per box, one 512 KiB run per (sequence, KV head)."""
    row = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    acc = tl.zeros([16, D], tl.float32)
    ones = tl.full([16, BN], 1.0, tl.float32).to(k_desc.dtype)
    for t in range(0, ctx, BN):
        acc = tl.dot(ones, k_desc.load([row, t, 0]).reshape(BN, D), acc)
        acc = tl.dot(ones, v_desc.load([row, t, 0]).reshape(BN, D), acc)
    tl.store(out_ptr + row * D + tl.arange(0, D), tl.sum(acc, 0) / 16)


def read_contiguous(kc, vc, tokens, warps, stages):
    """Per (sequence, KV head) of (B, KV heads, context, D) K and V: the sum over all positions."""
    b, kvh, ctx, d = kc.shape
    descs = [TensorDescriptor.from_tensor(c.view(b * kvh, ctx, d), [1, tokens, d]) for c in (kc, vc)]
    out = torch.empty(b, kvh, d, dtype=torch.float32, device=kc.device)
    _read_contiguous_kernel[(kvh, b)](out, *descs, ctx, D=d, BN=tokens, num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _chunk_read_kernel(out_ptr, k_desc, v_desc, tables_ptr, ctx, stride_bt, D: tl.constexpr, BS: tl.constexpr,
                       CHUNK: tl.constexpr, FLAT: tl.constexpr):
    """The read-only control with block ids loaded CHUNK at a time as one vector and picked out of
    registers, as kernels/paged_attention.py's _decode_tma_kernel does (it began here as a decode
    kernel with this loop, at 742fe1e). FLAT asks the compiler to flatten the two loops into one
    (decode ran 0.21-0.25 ms so, at 742fe1e). ctx // BS must divide by CHUNK."""
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([16, D], tl.float32)
    ones = tl.full([16, BS], 1.0, tl.float32).to(k_desc.dtype)
    c = tl.arange(0, CHUNK)
    for c0 in tl.range(0, ctx // BS, CHUNK, flatten=FLAT):
        ids = tl.load(table + c0 + c)
        for j in tl.range(0, CHUNK):
            blk = tl.sum(tl.where(c == j, ids, 0))
            acc = tl.dot(ones, _load_block(v_desc, blk, kvh, BS, D), tl.dot(ones, _load_block(k_desc, blk, kvh, BS, D), acc))
    tl.store(out_ptr + (seq * tl.num_programs(0) + kvh) * D + tl.arange(0, D), tl.sum(acc, 0) / 16)


def chunk_read(k_cache, v_cache, tables, ctx, chunk, flat, warps, stages):
    """Per (sequence, KV head): the sum over the first ctx positions of K and V, (num_seqs, kvh, d)."""
    _, bs, kvh, d = k_cache.shape
    descs = [TensorDescriptor.from_tensor(c.transpose(1, 2), [1, 1, bs, d]) for c in (k_cache, v_cache)]
    out = torch.empty(tables.shape[0], kvh, d, dtype=torch.float32, device=k_cache.device)
    _chunk_read_kernel[(kvh, tables.shape[0])](out, *descs, tables, ctx, tables.stride(0), D=d, BS=bs, CHUNK=chunk,
                                               FLAT=flat, num_warps=warps, num_stages=stages)
    return out


def chunk_decode(q, k_cache, v_cache, tables, seq_lens, scale, chunk, warps, stages):
    """The shipped TMA decode kernel with the given chunk of block ids, warps and stages."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_with(q, k_cache, v_cache, tables, seq_lens, qsl, scale, max_query_len=1, use_tma=True,
                                tma=TmaDecodeConfig(chunk, warps, stages))


# the other block sizes TMA can serve (tl.dot needs 16 keys, so not 8): a few configs each
AT_LARGER_BLOCKS = {"shipped default", "tma heads/program=2 warps=4 stages=3 ids_ahead=True",
                    "tma heads/program=4 warps=4 stages=2 ids_ahead=True",
                    "tma heads/program=4 warps=4 stages=3 ids_ahead=True"}
# (heads/program, warps, stages, block ids ahead); the call at a29b222 timed 11 single-head configs
# (then with up to 4 blocks per iteration) and these two were its best
TMA_CONFIGS = ((1, 1, 4, True), (1, 2, 4, True), (2, 2, 3, True), (2, 4, 3, True), (2, 4, 4, True), (4, 4, 2, True),
               (4, 4, 3, True), (4, 4, 4, True), (4, 8, 3, True), (4, 4, 3, False), (4, 4, 5, False), (8, 8, 2, True),
               (8, 8, 3, True))
# several KV heads per box with the context sliced so the grid stays at 512 programs: (heads/program,
# slices, warps, stages)
SPLIT_CONFIGS = ((2, 2, 2, 3), (2, 2, 4, 3), (4, 4, 4, 2), (4, 4, 4, 3), (8, 8, 4, 2), (8, 8, 8, 2), (8, 4, 8, 2))
# block ids a chunk at a time: (chunk, flatten, warps, stages)
# the TMA decode kernel: (chunk, warps, stages). 742fe1e timed chunks of 16 and 32, flattened or not,
# 1/2/4 warps, 3/4 stages (flattened 0.21-0.25 ms, 1 warp best); b7787f3 these, in this script's
# own copy of the kernel then
CHUNK_CONFIGS = ((32, 1, 3), (32, 1, 4), (32, 1, 5), (32, 1, 6), (64, 1, 4), (64, 1, 5), (16, 1, 5), (32, 2, 5),
                 (64, 2, 4))
# the chunked read control: (chunk, flatten, warps, stages)
CHUNK_READ_CONFIGS = ((32, False, 1, 4), (32, False, 2, 4), (32, True, 2, 3))
# the read-only control: (KV heads per box, context slices per program, warps, stages); slices keep
# 512 programs when a box spans several heads
CONTROL_CONFIGS = ((1, 1, 1, 3), (1, 1, 1, 4), (1, 1, 2, 4), (1, 1, 2, 6), (1, 1, 4, 4), (2, 2, 2, 4), (2, 2, 4, 4),
                   (4, 4, 4, 3), (4, 4, 4, 4), (8, 8, 4, 2), (8, 8, 8, 2), (8, 8, 4, 3))


# the benchmark case: B sequences of CTX tokens, HEADS / KVH heads of dimension D, bf16
B, CTX, HEADS, KVH, D = 64, 2048, 32, 8, 128
KV_BYTES = 2 * B * CTX * KVH * D * 2  # K and V, read once
SCALE = D ** -0.5


def record(rows: list[dict], name: str, ms: float, label: str = "", **extra: object) -> None:
    """One timing: into rows (with its effective KV bandwidth) and printed, after label."""
    rows.append({"name": name, "ms": ms, "TBps": KV_BYTES / ms / 1e9, **extra})
    print(f"{label}{name:70s} {ms:.4f} ms {KV_BYTES / ms / 1e9:.3f} TB/s", flush=True)


def chunked(bench: Bench) -> list[dict]:
    """Block ids a chunk at a time (decode and its read-only control) against the shipped kernel,
    SDPA, the ids-ahead read control and the contiguous read control, block 16."""
    rows: list[dict] = []
    b, ctx, heads, kvh, d, scale, bs = B, CTX, HEADS, KVH, D, SCALE, 16
    add = partial(record, rows, block=bs)
    ragged = bench.paged_batch([(n, 1) for n in torch.randint(1, 3000, (24,)).tolist()], heads, kvh, d, bs)
    ref = reference.paged_attention(*ragged, scale)
    batch = bench.paged_batch([(ctx, 1)] * b, heads, kvh, d, bs)
    q, k_cache, v_cache, tables = batch[:4]
    sums = (k_cache.float().sum(1) + v_cache.float().sum(1))[tables.long()].sum(1)  # (b, kvh, d)
    kc, vc = bench.contiguous_kv(batch, ctx)
    qb = q.view(b, heads, 1, d)
    sdpa = partial(F.scaled_dot_product_attention, qb, kc, vc, scale=scale, enable_gqa=True)
    shipped = partial(paged_attention_with, *batch[:5], batch[5], scale, max_query_len=1, decode=DecodeConfig())
    add("peer: SDPA on contiguous KV (#0)", bench.time_ms(sdpa))
    add("shipped default (#0)", bench.time_ms(shipped))
    for chunk, warps, stages in CHUNK_CONFIGS:
        name = f"TMA decode chunk={chunk} warps={warps} stages={stages}"
        err = rel(chunk_decode(*ragged[:5], scale, chunk, warps, stages), ref)
        if err > 2e-2:
            print(f"{name}: WRONG ({err:.1e})", flush=True)
            continue
        add(name, bench.time_ms(partial(chunk_decode, *batch[:5], scale, chunk, warps, stages)),
            config=(chunk, warps, stages))
    for chunk, flat, warps, stages in CHUNK_READ_CONFIGS:
        name = f"read-only chunk={chunk} flat={flat} warps={warps} stages={stages}"
        run = partial(chunk_read, k_cache, v_cache, tables, ctx, chunk, flat, warps, stages)
        if (err := rel(run(), sums)) > 1e-2:
            print(f"{name}: WRONG ({err:.1e})", flush=True)
            continue
        add(name, bench.time_ms(run))
    for warps, stages in ((2, 4), (4, 4)):
        add(f"read-only ids ahead warps={warps} stages={stages}",
               bench.time_ms(partial(read_only, k_cache, v_cache, tables, ctx, warps, stages)))
    for tokens, warps, stages in ((16, 2, 4), (128, 4, 3)):
        add(f"read-only contiguous KV tokens/box={tokens} warps={warps} stages={stages}",
               bench.time_ms(partial(read_contiguous, kc, vc, tokens, warps, stages)))
    add("peer: SDPA on contiguous KV (#1)", bench.time_ms(sdpa))
    add("shipped default (#1)", bench.time_ms(shipped))
    decode = sorted((r for r in rows if r["name"].startswith("TMA decode")), key=lambda r: r["ms"])[:2]
    for r in decode:
        add(f"{r['name']} again", bench.time_ms(partial(chunk_decode, *batch[:5], scale, *r["config"])))
    for other in (32, 64):
        batch = bench.paged_batch([(ctx, 1)] * b, heads, kvh, d, other)
        for r in decode:
            add(f"block={other} {r['name']}", bench.time_ms(partial(chunk_decode, *batch[:5], scale, *r["config"])))
        add(f"block={other} shipped default", bench.time_ms(
            partial(paged_attention_with, *batch[:5], batch[5], scale, max_query_len=1, decode=DecodeConfig())))
    return rows


def compare(bench: Bench) -> list[dict]:
    """The shipped TMA kernel against the pointer kernel and SDPA, interleaved over three rounds (the
    H200s lent differ by a few percent from call to call). At 3b0cec7 it also timed this script's
    own copy of the chunked kernel, since replaced by the shipped one."""
    rows: list[dict] = []
    b, ctx, heads, kvh, d, scale = B, CTX, HEADS, KVH, D, SCALE
    for bs in (16, 32):
        batch = bench.paged_batch([(ctx, 1)] * b, heads, kvh, d, bs)
        kc, vc = bench.contiguous_kv(batch, ctx)
        runs = {
            "peer: SDPA on contiguous KV": partial(F.scaled_dot_product_attention, batch[0].view(b, heads, 1, d), kc,
                                                   vc, scale=scale, enable_gqa=True),
            "shipped TMA kernel": partial(paged_attention_with, *batch, scale, max_query_len=1, use_tma=True),
            "shipped pointer kernel (the default)": partial(paged_attention_with, *batch, scale, max_query_len=1),
        }
        for rnd in range(3):
            for name, fn in runs.items():
                record(rows, name, bench.time_ms(fn), f"block={bs} round {rnd} ", block=bs, round=rnd)
        del batch, kc, vc
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--control-only", action="store_true", help="only SDPA, the shipped kernel, the split variants and the control")
    parser.add_argument("--compare", action="store_true", help="shipped TMA, chunked, pointer and SDPA, interleaved")
    parser.add_argument("--chunked", action="store_true", help="only the chunked-ids kernels and their controls")
    args = parser.parse_args()
    bench = Bench(args.out, "exp", sweep=False)  # its random batches, contiguous copies and timer
    if args.chunked:
        (args.out / "exp_decode_chunked.json").write_text(json.dumps(chunked(bench), indent=1))
        return
    if args.compare:
        (args.out / "exp_decode_compare.json").write_text(json.dumps(compare(bench), indent=1))
        return
    rows: list[dict] = []
    b, ctx, heads, kvh, d, scale = B, CTX, HEADS, KVH, D, SCALE
    variants = [("shipped default", None)]
    for hp, warps, stages, ahead in TMA_CONFIGS:
        name = (f"tma heads/program={hp} warps={warps} stages={stages} ids_ahead={ahead}" if hp > 1
                else f"tma warps={warps} stages={stages} ids_ahead={ahead}")
        variants.append((name, partial(tma_decode, heads_per_program=hp, warps=warps, stages=stages, ids_ahead=ahead)))
    for hp, splits, warps, stages in SPLIT_CONFIGS:
        variants.append((f"tma heads/program={hp} splits={splits} warps={warps} stages={stages}",
                         partial(tma_decode, heads_per_program=hp, warps=warps, stages=stages, ids_ahead=True,
                                 splits=splits)))

    def shipped(q, k, v, t, s, sc, qsl):
        return paged_attention_with(q, k, v, t, s, qsl, sc, max_query_len=1, decode=DecodeConfig())

    def add(bs: int, name: str, ms: float, **extra: float) -> None:
        record(rows, name, ms, f"block={bs} ", block=bs, **extra)

    for bs in (16, 32, 64):
        # correctness on ragged lengths first, then timing on the benchmark case
        ragged = bench.paged_batch([(n, 1) for n in torch.randint(1, 3000, (24,)).tolist()], heads, kvh, d, bs)
        ref = reference.paged_attention(*ragged, scale)
        batch = bench.paged_batch([(ctx, 1)] * b, heads, kvh, d, bs)
        todo = variants if bs == 16 else [v for v in variants if v[0] in AT_LARGER_BLOCKS]
        for name, fn in [v for v in todo if v[1] is None or 'splits=' in v[0]] if args.control_only else todo:
            try:
                run = (partial(shipped, *batch[:5], scale, batch[5]) if fn is None
                       else partial(fn, *batch[:5], scale))
                err = rel(shipped(*ragged[:5], scale, ragged[5]) if fn is None else fn(*ragged[:5], scale), ref)
                if err > 2e-2:
                    print(f"block={bs} {name}: WRONG (rel err {err:.2e})", flush=True)
                    rows.append({"block": bs, "name": name, "error": f"rel err {err:.2e}"})
                    continue
                ms = bench.time_ms(run)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result
                print(f"block={bs} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                traceback.print_exc(limit=2)
                rows.append({"block": bs, "name": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            add(bs, name, ms, err=err)
        if bs == 16:
            kc, vc = bench.contiguous_kv(batch, ctx)
            qb = batch[0].view(b, heads, 1, d)
            timed = [r for r in rows if r.get("ms") and r["name"].startswith("tma")]
            best = min(timed, key=lambda r: r["ms"])["name"] if timed else None
            for rep in range(2):
                if best:
                    add(bs, f"{best} again (#{rep})", bench.time_ms(partial(dict(variants)[best], *batch[:5], scale)))
                add(bs, f"peer: SDPA on contiguous KV (#{rep})",
                       bench.time_ms(partial(F.scaled_dot_product_attention, qb, kc, vc, scale=scale, enable_gqa=True)))
                add(bs, f"shipped default again (#{rep})", bench.time_ms(partial(shipped, *batch[:5], scale, batch[5])))
            # the control on SDPA's own contiguous layout, then SDPA again
            want = kc.float().sum(2) + vc.float().sum(2)
            for tokens, warps, stages in ((16, 1, 4), (16, 2, 4), (64, 2, 3), (64, 4, 3), (64, 4, 4), (128, 4, 2),
                                          (128, 4, 3)):
                run = partial(read_contiguous, kc, vc, tokens, warps, stages)
                err = rel(run(), want)
                if err > 1e-2:
                    print(f"read-only contiguous {tokens}x{warps}x{stages}: WRONG ({err:.1e})", flush=True)
                    continue
                add(bs, f"read-only contiguous KV tokens/box={tokens} warps={warps} stages={stages}",
                       bench.time_ms(run))
            add(bs, "peer: SDPA on contiguous KV (#2)",
                   bench.time_ms(partial(F.scaled_dot_product_attention, qb, kc, vc, scale=scale, enable_gqa=True)))
            del kc, vc
        del batch
    # control: the same reads without the attention math, random and sequential block tables
    # (at fb6e7fc a pointer-load version ran 0.17-0.27 ms: loads that feed no tl.dot are not
    # pipelined, so it measured latency, not the access pattern)
    for bs in (16, 64):
        _, k_cache, v_cache, tables, _, _ = bench.paged_batch([(ctx, 1)] * b, heads, kvh, d, bs)
        sequential = torch.arange(tables.numel(), dtype=torch.int32, device=tables.device).view_as(tables)
        want = (k_cache.float().sum(1) + v_cache.float().sum(1))[tables.long()].sum(1)  # (b, kvh, d)
        for hp, splits, warps, stages in CONTROL_CONFIGS:
            if hp * bs * d * 2 * 2 * stages > 200 * 1024 or (ctx // bs) % splits:
                continue  # K and V boxes, stages deep, must fit in shared memory
            for order, tab in (("random", tables), ("sequential", sequential)):
                name = f"read-only {order} tables heads/box={hp} splits={splits} warps={warps} stages={stages}"
                run = partial(read_only, k_cache, v_cache, tab, ctx, warps, stages, hp, splits)
                try:
                    got = run()
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
                    print(f"block={bs} {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    break
                err = rel(got, want.view(b, kvh // hp, hp, d).sum(2))
                if order == "random" and err > 1e-2:
                    print(f"block={bs} {name}: WRONG ({err:.1e})", flush=True)
                    break
                add(bs, name, bench.time_ms(run))
        del k_cache, v_cache, tables, sequential
    (args.out / "exp_decode_paging.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
