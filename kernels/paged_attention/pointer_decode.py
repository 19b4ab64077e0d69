"""The pointer decode kernel: attention of sequences with one new token, reading the cache
through per-token block ids, optionally with the context split over several programs.

* `_decode_kernel`, grid (num_kv_heads, num_seqs, num_splits): one program per sequence and KV
  head packs the GQA group's query heads into the rows of one tile, so each K/V tile is read
  once for the whole group ("GQA packing"). It walks the context in tiles of BLOCK_N tokens
  gathered from several blocks (`tiles.attend_keys`). With num_splits > 1 each program takes one
  slice of the context ("split-KV", flash-decoding) and writes a partial output and its
  log-sum-exp; `_reduce_kernel` merges the slices.
* The slices are cut from each sequence's own context (`_slice_len`), not from the block
  table's width: a CUDA graph's tables are as wide as max_model_len, and slices cut from that
  width left a 600-token context to one slice (one program per KV head) however many the launch
  had. Each sequence's context goes into num_splits slices of at least MIN_SPLIT tokens; the
  programs of slices past its end return at once.
* MULTI builds a variant where a program loops over every query token of its sequence, so any
  q_len stays correct; the launcher uses it when it cannot rule out multi-token sequences in a
  batch with as many tokens as sequences (see `launcher.py`). The loop changes the code Triton
  generates for the single-token path too, so each variant has its own default tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpilot.kernels.host import cdiv, next_power_of_2
from kvpilot.kernels.paged_attention.launch_args import LaunchArgs
from kvpilot.kernels.paged_attention.tiles import attend_keys, load_tile, score_scales


# Defaults from `benchmarks/bench_kernels.py --sweep` (benchmarks/history/2026-12-03.md, "Kernels"):
# what decides them is how many programs fit on an SM at once, set by registers and shared memory
# (`benchmarks/compile_probe.py`); configs that leave a second, mostly empty wave are slower.
# Block ids one tile ahead (prefetch) gained nothing measurable in decode, so it stays off here.
@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64  # context tokens per K/V tile (several cache blocks when block_size < it)
    num_warps: int = 2
    num_stages: int = 2
    prefetch: bool = False  # block ids one tile ahead (see tiles.attend_keys)
    min_split: int = 64  # fewest context tokens in a split-KV slice (rounded up to whole tiles)


# the MULTI kernel compiles differently: 128-token tiles suit it, while they slow the single-token one
MULTI_DECODE = DecodeConfig(block_n=128, num_warps=4, num_stages=2)


@triton.jit
def _slice_len(ctx, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Tokens in each split-KV slice of a context of ctx tokens: an even cut into num_splits, at
    least MIN_SPLIT (then fewer slices hold the context and the rest are empty), in whole tiles."""
    return tl.cdiv(tl.maximum(tl.cdiv(ctx, num_splits), MIN_SPLIT), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_token(
    out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_base, v_base, table, tok, kv_len, split,
    split_size, scale_log2, out_scale, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_vb, stride_vs, stride_pt, stride_ph, stride_ps,
    heads, row_ok, d, d_ok,
    M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Attention of query token `tok` (its GQA group's heads as rows) over keys [lo, hi) of its
    slice of the first kv_len context positions: full tiles unmasked, then the masked tail; the
    output is multiplied by out_scale (an FP8 cache's v_scale)."""
    lo = split * split_size
    hi = tl.minimum(lo + split_size, kv_len)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    q = load_tile(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
                  row_ok, d_ok, HEAD_DIM, D_PAD, True)  # (M, D_PAD)
    pos = tl.zeros([M], tl.int32) + (hi - 1)  # every row (head) sees the whole slice
    m_i, l_i, acc = attend_keys(q, k_base, v_base, table, lo, full_hi, hi, pos, scale_log2, d, d_ok,
                                stride_kb, stride_ks, stride_vb, stride_vs, M, HEAD_DIM, D_PAD,
                                BLOCK_SIZE, BLOCK_N, PRECISION, PREFETCH)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None] * out_scale
    if SPLIT:
        part = tok * stride_pt + heads * stride_ph + split * stride_ps  # (M,)
        tl.store(part_out_ptr + part[:, None] + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        lse = m_i + tl.log2(l_safe)  # -inf for an empty slice
        # part_lse is part_out without its D_PAD axis, so its offset is part // D_PAD
        tl.store(part_lse_ptr + part // D_PAD, lse, mask=row_ok)
    else:
        tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# the block tables' row stride is the widest table of the step: not specialised (prefill.py says
# why). The part_* strides are multiples of D_PAD (>= 16), so their one specialisation is reached
# by every launch.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, kv_scales_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pt, stride_ph, stride_ps,
    GROUP: tl.constexpr, M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, MULTI: tl.constexpr,
    PRECISION: tl.constexpr, PREFETCH: tl.constexpr, MIN_SPLIT: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid (num_kv_heads, num_seqs, num_splits). Memory layout, element strides:
    q/out (num_tokens, num_heads, head_dim): (stride_qt, stride_qh, 1) / (stride_ot, stride_oh, 1);
    k/v cache (num_blocks, block_size, num_kv_heads, head_dim): (stride_kb, stride_ks, stride_kh, 1),
    likewise stride_v*; block_tables (num_seqs, max_blocks) int32: (stride_bt, 1); seq_lens and
    query_start_loc (qsl) contiguous int32. With SPLIT, part_out (num_tokens, num_heads,
    num_splits, D_PAD) float32 contiguous: (stride_pt, stride_ph, stride_ps, 1) and part_lse its
    (num_tokens, num_heads, num_splits) float32 twin. M is GROUP rounded up to a power of two
    >= 16 (a tl.dot dimension); rows past GROUP are masked. Slice `split` of a sequence is keys
    [split * L, (split + 1) * L) with L = _slice_len(its context, num_splits). KV_FP8: the caches
    hold float8 e4m3, de-quantised by the (k_scale, v_scale) float32 pair at kv_scales_ptr."""
    # KV head fastest: programs side by side share a sequence's cache rows (sequence-fastest
    # order timed within noise of it)
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    ctx = tl.load(seq_lens_ptr + seq)
    if SPLIT:
        split_size = _slice_len(ctx, tl.num_programs(2), BLOCK_N, MIN_SPLIT)
        if split * split_size >= ctx:  # past this sequence's context: the reduce skips the slice
            return
    else:
        split_size = ctx
    rows = tl.arange(0, M)
    row_ok = rows < GROUP
    heads = kvh * GROUP + rows
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    qk_scale, out_scale = score_scales(scale_log2, kv_scales_ptr, KV_FP8)
    if q_end - q_start == 1:
        # the decode case, kept out of any outer loop: nested in the token loop below, the tile
        # loop compiles to slower code (benchmarks/history/2026-12-03.md, "Kernels": the
        # multi-token loop)
        _decode_token(out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_base, v_base, table, q_start,
                      ctx, split, split_size, qk_scale, out_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_kb, stride_ks, stride_vb, stride_vs, stride_pt, stride_ph, stride_ps,
                      heads, row_ok, d, d_ok, M, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, SPLIT, PRECISION, PREFETCH)
    elif MULTI:
        # an all-decode-sized batch that may hold empty sequences: this program takes every query
        # token of its sequence; token tok sits at context position ctx - (q_end - tok)
        for tok in range(q_start, q_end):
            _decode_token(out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_base, v_base, table, tok,
                          ctx - q_end + tok + 1, split, split_size, qk_scale, out_scale, stride_qt, stride_qh,
                          stride_ot, stride_oh, stride_kb, stride_ks, stride_vb, stride_vs,
                          stride_pt, stride_ph, stride_ps, heads, row_ok, d, d_ok,
                          M, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, SPLIT, PRECISION, PREFETCH)


# num_splits takes many values (with the block tables' width): not specialised, so one compiled
# kernel per SPLITS_PAD serves them all
@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, qsl_ptr,
    handle_multi, num_splits, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
):
    """Merge the split-KV partial outputs of one (sequence, query head); grid (num_seqs,
    num_heads). Layouts and strides as in `_decode_kernel`; SPLITS_PAD is num_splits rounded up
    to a power of two. handle_multi (0/1) says whether sequences with q_len != 1 were decoded.
    The slices are those `_decode_kernel` cut (`_slice_len`); only the non-empty ones are read."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    if (handle_multi == 0) & (q_end - q_start != 1):
        return
    ctx = tl.load(seq_lens_ptr + seq)
    split_size = _slice_len(ctx, num_splits, BLOCK_N, MIN_SPLIT)
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


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                      min_split: int = DecodeConfig.min_split) -> int:
    """Split the context only when the (sequence, KV head) programs cannot fill the chip; no
    more slices than the longest context allowed (`max_context`) has of `min_split` tokens."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    programs = num_seqs * num_kv_heads
    if programs >= 2 * sms:
        return 1
    # at most one wave of two programs per SM, rounded down: one program past a full wave leaves
    # a second, nearly empty one (benchmarks/history/2026-12-03.md, "Kernels": split-KV)
    by_occupancy = max(1, (2 * sms) // programs)
    by_length = cdiv(max_context, min_split)
    return max(1, min(by_occupancy, by_length, 64))


def launch(args: LaunchArgs, config: DecodeConfig, num_splits: int, multi: bool) -> None:
    """Decode the sequences with one new token (every sequence's tokens when `multi`) into
    args.out, each context cut into up to num_splits slices (`_slice_len`). The layouts in args
    passed `launcher.check`."""
    out, q = args.out, args.q
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = args.k_cache.shape
    num_seqs = args.block_tables.shape[0]
    d_pad = args.d_pad
    if num_splits > 1:
        part_out = torch.empty((num_tokens, num_heads, num_splits, d_pad), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32,
                               device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        out, part_out, part_lse, q, args.k_cache, args.v_cache, args.block_tables, args.seq_lens,
        args.query_start_loc, args.scales_arg, args.scale_log2,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *args.cache_strides,
        num_heads * num_splits * d_pad, num_splits * d_pad, d_pad,
        GROUP=args.group, M=max(16, next_power_of_2(args.group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=config.block_n, SPLIT=num_splits > 1, MULTI=multi,
        PRECISION=args.precision, PREFETCH=config.prefetch, MIN_SPLIT=config.min_split, KV_FP8=args.kv_fp8,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, args.seq_lens, args.query_start_loc, int(multi), num_splits,
            out.stride(0), out.stride(1), num_heads * num_splits * d_pad, num_splits * d_pad, d_pad,
            HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_PAD=next_power_of_2(num_splits), BLOCK_N=config.block_n,
            MIN_SPLIT=config.min_split, num_warps=4,
        )
