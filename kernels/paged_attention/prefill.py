"""The prefill kernel: flash-attention tiles with tl.dot for sequences with several new tokens
(prefill and chunked prefill) in a varlen batch, the GQA group's heads packed into each tile's
rows so that K/V tiles are shared by the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from kvpilot.kernels.paged_attention.launch_args import LaunchArgs
from kvpilot.kernels.paged_attention.tiles import attend_keys, load_tile, score_scales


# Defaults from `benchmarks/bench_kernels.py --sweep` (benchmarks/history/2026-12-03.md, "Kernels").
# Block ids one tile ahead let the pipeliner keep two K/V buffers in flight, which this
# compute-bound kernel uses; larger tiles were faster on chunked prefill only and slower on
# prefill, so one default covers both.
@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 64  # query rows per tile: (block_m // group) tokens x group heads
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = True  # block ids one tile ahead (see tiles.attend_keys)


# num_seqs and the block tables' row stride (the widest table of the step) change from step to
# step; Triton would compile a variant for each of "1", "a multiple of 16" and "other" the first
# time a step shows one, mid-run (a stall of every request). Neither feeds an address the
# compiler could vectorise: the table is read one block id per lane.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, kv_scales_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, PREFETCH: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads). A tile's BLOCK_M rows are BLOCK_Q
    query tokens x the GQA group's heads (row m -> token m // GROUP, head m % GROUP). Sequence i
    owns the program ids starting at qsl[i] // BLOCK_Q + i (an upper bound on the tiles it needs,
    found by binary search), so the grid is known from shapes alone; programs past a sequence's
    tokens, and sequences with q_len <= 1 (the decode kernels' part), return at once.

    Memory layout, element strides: q/out (num_tokens, num_heads, head_dim): (stride_qt,
    stride_qh, 1) / (stride_ot, stride_oh, 1); k/v cache (num_blocks, block_size, num_kv_heads,
    head_dim): (stride_kb, stride_ks, stride_kh, 1), likewise stride_v*; block_tables (num_seqs,
    max_blocks) int32: (stride_bt, 1); seq_lens and query_start_loc (qsl) contiguous int32.
    KV_FP8: the caches hold float8 e4m3, de-quantised by the (k_scale, v_scale) float32 pair at
    kv_scales_ptr."""
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
    q = load_tile(q_ptr + (q_rows * stride_qt + heads * stride_qh)[:, None] + d[None, :],
                  row_ok, d_ok, HEAD_DIM, D_PAD, True)  # (BLOCK_M, D_PAD)
    first_pos = ctx - q_len + q0
    hi_n = ctx - q_len + tl.minimum(q0 + BLOCK_Q, q_len)  # keys past the tile's last query: masked
    full_n = (first_pos + 1) // BLOCK_N * BLOCK_N  # tiles every row of this tile sees entirely
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    qk_scale, out_scale = score_scales(scale_log2, kv_scales_ptr, KV_FP8)
    _, l_i, acc = attend_keys(q, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, table, 0, full_n, hi_n,
                              pos, qk_scale, d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs,
                              BLOCK_M, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, PRECISION, PREFETCH)
    o = acc / l_i[:, None] * out_scale
    tl.store(out_ptr + (q_rows * stride_ot + heads * stride_oh)[:, None] + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def launch(args: LaunchArgs, config: PrefillConfig) -> None:
    """Attend the sequences with several new tokens into args.out; the layouts in args passed
    `launcher.check`."""
    q, out = args.q, args.out
    num_tokens, _, head_dim = q.shape
    _, block_size, num_kv_heads, _ = args.k_cache.shape
    num_seqs = args.block_tables.shape[0]
    block_q = config.block_m // args.group
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        out, q, args.k_cache, args.v_cache, args.block_tables, args.seq_lens, args.query_start_loc,
        args.scales_arg, args.scale_log2, num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *args.cache_strides,
        GROUP=args.group, BLOCK_M=config.block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, D_PAD=args.d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=config.block_n, PRECISION=args.precision, PREFETCH=config.prefetch,
        KV_FP8=args.kv_fp8, num_warps=config.num_warps, num_stages=config.num_stages,
    )
