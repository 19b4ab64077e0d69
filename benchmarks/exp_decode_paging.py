"""Experiments on the last gap of issue 5: block-16 paged decode against SDPA on contiguous KV.

Not part of the engine. Timed against the shipped decode kernel and SDPA in one process (B=64 x
2048, 32/8 heads, head dim 128, bf16, head-major cache, random block tables):
* `_tma_decode_kernel`: one tensor-descriptor (TMA) load per (cache block, KV head), i.e. one bulk
  copy of the block's contiguous block_size x 256-byte run, TILES blocks per loop iteration, block
  ids loaded an iteration ahead (IDS_AHEAD) or not.
* `_tma_heads_kernel`: one TMA box over HP adjacent KV heads of a block (HP x 4 KiB contiguous at
  block 16), the HP x GROUP query heads as the rows of one block-diagonal tile.
* `_read_kernel`: a control, the same TMA reads without the attention math, on random and on
  sequential block tables: how fast the access pattern streams at all.
Two other ideas were timed at d1e0178 and dropped (both slower than the shipped kernel, see
benchmarks/RESULTS.md): several KV heads per program with pointer loads, and an L2 bulk prefetch
of the blocks a few tiles ahead.
Each variant is checked against the reference before it is timed; a variant that fails to
compile or differs is reported and skipped.
    python benchmarks/exp_decode_paging.py [--out DIR] [--control-only]
"""

from __future__ import annotations

import argparse
import json
import math
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
    paged_attention_with,
)


@triton.jit
def _softmax_step(q, k, v, keep, m_i, l_i, acc, scale_log2, MASKED: tl.constexpr):
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED:
        s = tl.where(keep[None, :], s, float("-inf"))
        v = tl.where(keep[:, None], v, 0.0)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _load_block(desc, blk, kvh, BS: tl.constexpr, D: tl.constexpr):
    return desc.load([blk, kvh, 0, 0]).reshape(BS, D)


@triton.jit
def _tma_decode_kernel(
    out_ptr, q_ptr, k_desc, v_desc, tables_ptr, seq_lens_ptr, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILES: tl.constexpr,
    IDS_AHEAD: tl.constexpr,
):
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    ctx = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, M)
    row_ok = rows < GROUP
    heads = kvh * GROUP + rows
    d = tl.arange(0, D)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    offs = tl.arange(0, BS)
    full = ctx // (BS * TILES) * TILES  # blocks covered by whole iterations
    if IDS_AHEAD:  # the block ids of the first iteration (0 past the end: block 0 exists)
        n0 = tl.load(table, mask=full > 0, other=0)
        n1 = tl.load(table + 1, mask=TILES >= 2 and full > 1, other=0)
        n2 = tl.load(table + 2, mask=TILES >= 4 and full > 2, other=0)
        n3 = tl.load(table + 3, mask=TILES >= 4 and full > 3, other=0)
    for b in range(0, full, TILES):
        if IDS_AHEAD:
            # this iteration's ids came from the previous one, so its TMA loads depend on no
            # load of their own iteration and the pipeliner can buffer them num_stages deep
            b0, b1, b2, b3 = n0, n1, n2, n3
            more = b + TILES < full
            n0 = tl.load(table + b + TILES, mask=more, other=0)
            if TILES >= 2:
                n1 = tl.load(table + b + TILES + 1, mask=more, other=0)
            if TILES >= 4:
                n2 = tl.load(table + b + TILES + 2, mask=more, other=0)
                n3 = tl.load(table + b + TILES + 3, mask=more, other=0)
        else:
            b0 = tl.load(table + b)
            b1 = tl.load(table + b + 1, mask=TILES >= 2, other=0)
            b2 = tl.load(table + b + 2, mask=TILES >= 4, other=0)
            b3 = tl.load(table + b + 3, mask=TILES >= 4, other=0)
        k0 = _load_block(k_desc, b0, kvh, BS, D)
        v0 = _load_block(v_desc, b0, kvh, BS, D)
        m_i, l_i, acc = _softmax_step(q, k0, v0, offs, m_i, l_i, acc, scale_log2, False)
        if TILES >= 2:
            k1 = _load_block(k_desc, b1, kvh, BS, D)
            v1 = _load_block(v_desc, b1, kvh, BS, D)
            m_i, l_i, acc = _softmax_step(q, k1, v1, offs, m_i, l_i, acc, scale_log2, False)
        if TILES >= 4:
            k2 = _load_block(k_desc, b2, kvh, BS, D)
            v2 = _load_block(v_desc, b2, kvh, BS, D)
            k3 = _load_block(k_desc, b3, kvh, BS, D)
            v3 = _load_block(v_desc, b3, kvh, BS, D)
            m_i, l_i, acc = _softmax_step(q, k2, v2, offs, m_i, l_i, acc, scale_log2, False)
            m_i, l_i, acc = _softmax_step(q, k3, v3, offs, m_i, l_i, acc, scale_log2, False)
    for b in range(full, tl.cdiv(ctx, BS)):
        blk = tl.load(table + b)
        k = _load_block(k_desc, blk, kvh, BS, D)
        v = _load_block(v_desc, blk, kvh, BS, D)
        m_i, l_i, acc = _softmax_step(q, k, v, b * BS + offs < ctx, m_i, l_i, acc, scale_log2, True)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def tma_decode(q, k_cache, v_cache, tables, seq_lens, scale, tiles, warps, stages, ids_ahead=False):
    """Single-token decode through per-block TMA loads; the caches must be head-major views."""
    num_tokens, num_heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    descs = [TensorDescriptor.from_tensor(c.transpose(1, 2), [1, 1, bs, d]) for c in (k_cache, v_cache)]
    out = torch.empty_like(q)
    group = num_heads // kvh
    _tma_decode_kernel[(kvh, tables.shape[0])](
        out, q, *descs, tables, seq_lens, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        tables.stride(0), GROUP=group, M=max(16, triton.next_power_of_2(group)), D=d, BS=bs, TILES=tiles,
        IDS_AHEAD=ids_ahead, num_warps=warps, num_stages=stages,
    )
    return out


@triton.jit
def _tma_heads_kernel(
    out_ptr, q_ptr, k_desc, v_desc, tables_ptr, seq_lens_ptr, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, HP: tl.constexpr,
    IDS_AHEAD: tl.constexpr,
):
    """HP adjacent KV heads per program: one TMA box per cache block covers their head-major runs,
    (HP x block_size x 256 B) contiguous. Rows are the HP x GROUP query heads (GQA packing over
    several KV heads), columns HP x block_size keys; a row scores only its own KV head's keys, so
    the product is block-diagonal and costs what the padded single-head tile costs."""
    kvh0 = tl.program_id(0) * HP
    seq = tl.program_id(1)
    ctx = tl.load(seq_lens_ptr + seq)
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
    nblocks = tl.cdiv(ctx, BS)
    nxt = tl.load(table, mask=nblocks > 0, other=0)
    for b in range(0, nblocks):
        if IDS_AHEAD:
            blk = nxt
            nxt = tl.load(table + b + 1, mask=b + 1 < nblocks, other=0)
        else:
            blk = tl.load(table + b)
        k = k_desc.load([blk, kvh0, 0, 0]).reshape(HP * BS, D)
        v = v_desc.load([blk, kvh0, 0, 0]).reshape(HP * BS, D)
        keep = own & (b * BS + cols % BS < ctx)[None, :]
        s = tl.where(keep, tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.where((b * BS + cols % BS < ctx)[:, None], v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def tma_heads_decode(q, k_cache, v_cache, tables, seq_lens, scale, heads_per_program, warps, stages, ids_ahead):
    num_tokens, num_heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    hp = heads_per_program
    descs = [TensorDescriptor.from_tensor(c.transpose(1, 2), [1, hp, bs, d]) for c in (k_cache, v_cache)]
    out = torch.empty_like(q)
    group = num_heads // kvh
    _tma_heads_kernel[(kvh // hp, tables.shape[0])](
        out, q, *descs, tables, seq_lens, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        tables.stride(0), GROUP=group, M=max(16, triton.next_power_of_2(hp * group)), D=d, BS=bs, HP=hp,
        IDS_AHEAD=ids_ahead, num_warps=warps, num_stages=stages,
    )
    return out


@triton.jit
def _read_kernel(out_ptr, k_desc, v_desc, tables_ptr, ctx, stride_bt,
                 D: tl.constexpr, BS: tl.constexpr, USE_DOT: tl.constexpr):
    """A control with no attention math: the same per-block TMA reads as _tma_decode_kernel (block
    ids an iteration ahead), reduced to column sums. How fast can this access pattern be streamed
    at all? USE_DOT sums through tl.dot with a ones matrix instead of tl.sum."""
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    nblocks = ctx // BS
    nxt = tl.load(table)
    if USE_DOT:
        acc = tl.zeros([16, D], tl.float32)
        ones = tl.full([16, BS], 1.0, tl.float32).to(k_desc.dtype)
    else:
        acc = tl.zeros([D], tl.float32)
    for b in range(0, nblocks):
        blk = nxt
        nxt = tl.load(table + b + 1, mask=b + 1 < nblocks, other=0)
        k = _load_block(k_desc, blk, kvh, BS, D)
        v = _load_block(v_desc, blk, kvh, BS, D)
        if USE_DOT:
            acc = tl.dot(ones, k, acc)
            acc = tl.dot(ones, v, acc)
        else:
            acc += tl.sum(k.to(tl.float32), 0) + tl.sum(v.to(tl.float32), 0)
    d = tl.arange(0, D)
    if USE_DOT:
        tl.store(out_ptr + (seq * tl.num_programs(0) + kvh) * D + d, tl.sum(acc, 0) / 16)
    else:
        tl.store(out_ptr + (seq * tl.num_programs(0) + kvh) * D + d, acc)


def read_only(k_cache, v_cache, tables, ctx, warps, stages, use_dot):
    _, bs, kvh, d = k_cache.shape
    descs = [TensorDescriptor.from_tensor(c.transpose(1, 2), [1, 1, bs, d]) for c in (k_cache, v_cache)]
    out = torch.empty(tables.shape[0], kvh, d, dtype=torch.float32, device=k_cache.device)
    _read_kernel[(kvh, tables.shape[0])](out, *descs, tables, ctx, tables.stride(0), D=d, BS=bs, USE_DOT=use_dot,
                                         num_warps=warps, num_stages=stages)
    return out


def paged_batch(lens, heads, kv_heads, d, bs, device):
    per_seq = [-(-n // bs) for n in lens]
    pool = torch.randperm(sum(per_seq), device=device).int()
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = pool[used:used + n]
        used += n
    k_cache, v_cache = (reference.kv_cache_empty(sum(per_seq), bs, kv_heads, d, head_major=True,
                                                 dtype=torch.bfloat16, device=device) for _ in range(2))
    k_cache.normal_()
    v_cache.normal_()
    q = torch.randn(len(lens), heads, d, dtype=torch.bfloat16, device=device)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, seq_lens, qsl


# the other block sizes TMA can serve (tl.dot needs 16 keys, so not 8): a few configs each
AT_LARGER_BLOCKS = {"shipped default", "tma heads/program=2 warps=4 stages=3 ids_ahead=True",
                    "tma heads/program=4 warps=4 stages=2 ids_ahead=True",
                    "tma heads/program=4 warps=4 stages=3 ids_ahead=True"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--control-only", action="store_true", help="only SDPA, the shipped kernel and the control")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    rows: list[dict] = []

    def time_ms(fn) -> float:
        fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))

    def rel(a, b) -> float:
        return math.inf if a.isnan().any() else ((a.double() - b.double()).norm() / b.double().norm()).item()

    b, ctx, heads, kvh, d = 64, 2048, 32, 8, 128
    kv_bytes = 2 * b * ctx * kvh * d * 2
    scale = d ** -0.5
    variants = [("shipped default", None)]
    # single-head TMA: the call at a29b222 timed 11 configs; these two were its best
    for tiles, warps, stages, ahead in ((1, 1, 4, True), (1, 2, 4, True)):
        variants.append((f"tma tiles={tiles} warps={warps} stages={stages} ids_ahead={ahead}",
                         partial(tma_decode, tiles=tiles, warps=warps, stages=stages, ids_ahead=ahead)))
    for hp, warps, stages, ahead in ((2, 2, 3, True), (2, 4, 3, True), (2, 4, 4, True), (4, 4, 2, True),
                                     (4, 4, 3, True), (4, 4, 4, True), (4, 8, 3, True), (4, 4, 3, False),
                                     (4, 4, 5, False), (8, 8, 2, True), (8, 8, 3, True)):
        variants.append((f"tma heads/program={hp} warps={warps} stages={stages} ids_ahead={ahead}",
                         partial(tma_heads_decode, heads_per_program=hp, warps=warps, stages=stages, ids_ahead=ahead)))

    def shipped(q, k, v, t, s, sc, qsl):
        return paged_attention_with(q, k, v, t, s, qsl, sc, max_query_len=1, decode=DecodeConfig())

    for bs in (16, 32, 64):
        # correctness on ragged lengths first, then timing on the benchmark case
        ragged = paged_batch(torch.randint(1, 3000, (24,)).tolist(), heads, kvh, d, bs, dev)
        ref = reference.paged_attention(*ragged, scale)
        batch = paged_batch([ctx] * b, heads, kvh, d, bs, dev)
        q, k_cache, v_cache, tables, seq_lens, qsl = batch
        todo = variants if bs == 16 else [v for v in variants if v[0] in AT_LARGER_BLOCKS]
        for name, fn in todo[:1] if args.control_only else todo:
            try:
                run = (partial(shipped, *batch[:5], scale, qsl) if fn is None
                       else partial(fn, *batch[:5], scale))
                check = (shipped(*ragged[:5], scale, ragged[5]) if fn is None else fn(*ragged[:5], scale))
                err = rel(check, ref)
                if err > 2e-2:
                    print(f"block={bs} {name}: WRONG (rel err {err:.2e})", flush=True)
                    rows.append({"block": bs, "name": name, "error": f"rel err {err:.2e}"})
                    continue
                ms = time_ms(run)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result
                print(f"block={bs} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                traceback.print_exc(limit=2)
                rows.append({"block": bs, "name": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            rows.append({"block": bs, "name": name, "ms": ms, "TBps": kv_bytes / ms / 1e9, "err": err})
            print(f"block={bs} {name:60s} {ms:.4f} ms {kv_bytes / ms / 1e9:.3f} TB/s err {err:.1e}", flush=True)
        if bs == 16:
            kc = k_cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
            vc = v_cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
            qb = q.view(b, heads, 1, d)
            timed = [r for r in rows if r.get("ms") and r["name"].startswith("tma")]
            best = min(timed, key=lambda r: r["ms"])["name"] if timed else None
            for rep in range(2):
                if best:
                    ms = time_ms(partial(dict(variants)[best], *batch[:5], scale))
                    rows.append({"block": bs, "name": f"{best} again (#{rep})", "ms": ms})
                    print(f"block={bs} {best} again #{rep} {ms:.4f} ms", flush=True)
                ms = time_ms(partial(F.scaled_dot_product_attention, qb, kc, vc, scale=scale, enable_gqa=True))
                rows.append({"block": bs, "name": f"peer: SDPA on contiguous KV (#{rep})", "ms": ms})
                print(f"block={bs} peer: SDPA contiguous #{rep} {ms:.4f} ms", flush=True)
                ms = time_ms(partial(shipped, *batch[:5], scale, qsl))
                rows.append({"block": bs, "name": f"shipped default again (#{rep})", "ms": ms})
                print(f"block={bs} shipped default again #{rep} {ms:.4f} ms", flush=True)
            del kc, vc
        del batch, k_cache, v_cache
    # control: the same reads without the attention math, random and sequential block tables
    # (at fb6e7fc a pointer-load version ran 0.17-0.27 ms: loads that feed no tl.dot are not
    # pipelined, so it measured latency, not the access pattern)
    for bs in (16, 64):
        batch = paged_batch([ctx] * b, heads, kvh, d, bs, dev)
        _, k_cache, v_cache, tables, _, _ = batch
        sequential = torch.arange(tables.numel(), dtype=torch.int32, device=dev).view_as(tables)
        want = (k_cache.float().sum(1) + v_cache.float().sum(1))[tables.long()].sum(1)  # (b, kvh, d)
        # tl.sum of the tiles compiles to one shared-memory buffer at any num_stages (loads that
        # feed no tl.dot are not pipelined); summing through tl.dot gets num_stages buffers
        for warps, stages, use_dot in ((2, 4, False), (1, 3, True), (1, 4, True), (2, 4, True), (2, 6, True),
                                       (4, 4, True)):
            for order, tab in (("random", tables), ("sequential", sequential)):
                name = f"read-only {order} tables warps={warps} stages={stages} dot={use_dot}"
                got = read_only(k_cache, v_cache, tab, ctx, warps, stages, use_dot)
                if order == "random" and rel(got, want) > 1e-2:
                    print(f"block={bs} {name}: WRONG ({rel(got, want):.1e})", flush=True)
                    continue
                ms = time_ms(partial(read_only, k_cache, v_cache, tab, ctx, warps, stages, use_dot))
                rows.append({"block": bs, "name": name, "ms": ms, "TBps": kv_bytes / ms / 1e9})
                print(f"block={bs} {name:60s} {ms:.4f} ms {kv_bytes / ms / 1e9:.3f} TB/s", flush=True)
        del batch, k_cache, v_cache, sequential
    (args.out / "exp_decode_paging.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
