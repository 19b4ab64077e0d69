"""The TMA decode kernel (Hopper and later): single-token decode over unsplit contexts with each
cache block fetched by the Tensor Memory Accelerator, one bulk copy per (block, KV head) run of
a head-major cache, in place of the pointer kernel (`pointer_decode.py`).

It is a little faster on the device than the pointer kernel at 16- and 32-token blocks and
slower at 64 (benchmarks/history/2026-12-03.md, "Kernels"), but every launch has Triton's
launcher encode two CUtensorMaps on the host, which costs more host time than it saves on the
device. Under a CUDA graph that host work is paid once, at capture, so the engine's decode graphs
take it (`launcher.paged_attention(..., prefer_tma=True)`) and eager launches keep the pointer
kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kvpilot.kernels.host import INTERPRETING, next_power_of_2
from kvpilot.kernels.paged_attention.launch_args import LaunchArgs
from kvpilot.kernels.paged_attention.tiles import score_scales, softmax_update


# One config per block size the kernel reads, from `benchmarks/bench_kernels.py --tma-sweep`, each
# kernel replayed from a CUDA graph with L2 flushed, as the engine's decode graphs run it
# (benchmarks/history/2026-12-03.md, "Kernels"). One warp with 3-4 stages keeps enough bytes in
# flight per program; at block 16 ragged batches leave the longest sequences streaming alone at the end, where a program's
# bytes in flight (stages x one block) set the pace, hence 4 stages there.
@dataclass(frozen=True)
class TmaDecodeConfig:
    chunk: int = 64  # block ids loaded per vector load
    num_warps: int = 1
    num_stages: int = 3


DEFAULTS = {16: TmaDecodeConfig(num_stages=4), 32: TmaDecodeConfig()}
BLOCK_SIZES = tuple(DEFAULTS)


@triton.jit
def _attend_block(
    q, k_desc, v_desc, blk, kvh, key_ok, m_i, l_i, acc, scale_log2,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """One cache block of online softmax, K and V fetched as one TMA box each (the block's run
    for KV head kvh in a head-major cache), widened to q's dtype. MASKED scores only the keys in
    key_ok and zeroes the other value rows (slots past the context may hold anything, NaN included)."""
    k = k_desc.load([blk, kvh, 0, 0]).reshape(BLOCK_SIZE, HEAD_DIM).to(q.dtype)
    v = v_desc.load([blk, kvh, 0, 0]).reshape(BLOCK_SIZE, HEAD_DIM).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if MASKED:
        s = tl.where(key_ok[None, :], s, float("-inf"))
        v = tl.where(key_ok[:, None], v, 0.0)
    m_new, l_i, p, alpha = softmax_update(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


# the block tables' row stride is the widest table of the step: not specialised (prefill.py says
# why); the block ids' vector load of CHUNK ids gives up 16-byte accesses, once per CHUNK blocks
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_tma_kernel(
    out_ptr, q_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr, qsl_ptr, kv_scales_ptr, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid (num_kv_heads, num_seqs): one program per (sequence, KV head) with the GQA group's
    query heads as rows (M: GROUP rounded up to a power of two >= 16), one cache block per step.
    Sequences whose q_len is not 1 are left to the other kernels.

    Memory layout, element strides: q/out (num_tokens, num_heads, head_dim): (stride_qt,
    stride_qh, 1) / (stride_ot, stride_oh, 1); block_tables (num_seqs, max_blocks) int32:
    (stride_bt, 1); seq_lens and query_start_loc (qsl) contiguous int32. k_desc/v_desc are TMA
    descriptors over the head-major cache viewed as (num_blocks, num_kv_heads, block_size,
    head_dim), box (1, 1, BLOCK_SIZE, HEAD_DIM): each (block, KV head) one contiguous run. KV_FP8:
    the caches hold float8 e4m3, de-quantised by the (k_scale, v_scale) float32 pair at
    kv_scales_ptr (k_scale folded into the score scale, v_scale into the output).

    The block ids come CHUNK at a time in one vector load and are picked out of registers, so no
    TMA coordinate waits on a load of the step before it: the pipeliner then streams the boxes
    num_stages deep (with each id loaded a step ahead instead, the reads streamed measurably
    slower than TMA reads of contiguous KV: benchmarks/history/2026-12-03.md, "Kernels"). The
    full blocks go by chunks (the last one partial, its ids loaded masked), then the partly filled last block, if any,
    with its keys masked."""
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    tok = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - tok != 1:
        return
    ctx = tl.load(seq_lens_ptr + seq)
    scale_log2, out_scale = score_scales(scale_log2, kv_scales_ptr, KV_FP8)
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
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * out_scale
    tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why the TMA decode kernel cannot read these caches, or None when it can: it needs a
    Hopper or later GPU (or Triton's interpreter), head-major caches (each (block, KV head) one
    contiguous run, as the GPU engine allocates), 16- or 32-token blocks (the measured ones; the
    pointer kernel is faster at 64, and a tl.dot needs 16 keys), a power-of-two head dim (a box is
    one tensor) and 16-byte aligned bases."""
    if q.device.type == "cuda" and not INTERPRETING and torch.cuda.get_device_capability(q.device)[0] < 9:
        return "TMA needs a Hopper or later GPU (compute capability 9.0)"
    _, block_size, _, head_dim = k_cache.shape
    if block_size not in BLOCK_SIZES:
        return f"block_size {block_size} is not one of {BLOCK_SIZES}"
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} is not a power of two >= 16"
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.transpose(1, 2).is_contiguous():
            return f"{name} is not head-major (strides {tuple(cache.stride())})"
        if cache.data_ptr() % 16:
            return f"{name} does not start on a 16-byte boundary"
    return None


def launch(args: LaunchArgs, config: TmaDecodeConfig) -> None:
    """Decode the single-token sequences into args.out; the layouts in args passed
    `launcher.check`, and the caches `unsupported`."""
    q, out, k_cache = args.q, args.out, args.k_cache
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    # (num_blocks, num_kv_heads, block_size, head_dim) views of the head-major caches: one box per run
    descs = [TensorDescriptor.from_tensor(c.transpose(1, 2), [1, 1, block_size, head_dim])
             for c in (k_cache, args.v_cache)]
    _decode_tma_kernel[(num_kv_heads, args.block_tables.shape[0])](
        out, q, *descs, args.block_tables, args.seq_lens, args.query_start_loc, args.scales_arg, args.scale_log2,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), args.block_tables.stride(0),
        GROUP=args.group, M=max(16, next_power_of_2(args.group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        CHUNK=config.chunk, PRECISION=args.precision, KV_FP8=args.kv_fp8, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
