"""The FP8 KV cache on a GPU, in one run: correctness of every kernel path at real sizes, the KV
read of a batch-256 decode in bf16 and FP8, and the engine's decode step at batch 256 with a bf16
and an FP8 cache (bf16 weights both).

1. correctness (Llama-3-8B's attention: 32 query heads, 8 KV heads, head dim 128; bf16 queries;
   head-major caches as the engine allocates them, unused slots NaN): for block sizes 8/16/32/64,
   the cache write and the fused rotary write against torch's cast of x / scale, and paged
   attention over FP8 caches against de-quantise-then-bf16 attention (the reference over the
   de-quantised caches): pointer decode unsplit and split-KV, with and without max_query_len (the
   MULTI variant), TMA decode (blocks 16 and 32), prefill and chunked prefill in a mixed batch.
2. KV read: one decode step's attention over 32 layers of 256 sequences x 1,024 tokens, block 16,
   blocks in random order, replayed from a CUDA graph as the engine's decode graphs run it (TMA
   kernel) and with the pointer kernel; bf16 against FP8 caches, with the copy rate measured in
   the same run (the bytes a read must move over it are its floor).
3. engine: `LLM("llama-3-8b", load_format="dummy")` with --kv-cache-dtype auto and fp8, 256
   prompts of 960 tokens and 128 new each (context ~1,024 mid-decode), CUDA graphs and async
   scheduling on: the median full-batch decode step, output tok/s, and the KV cache's capacity in
   tokens at the same --gpu-memory-utilization.

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_kv_fp8_gpu.py [--out DIR] [--skip-engine]
Prints JSON lines as it goes and a table last; --out DIR gets bench_kv_fp8.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks below
import bench_engine_gpu as engine_bench  # noqa: E402
from bench_gemm_decode import captured  # noqa: E402

from kvpilot.kernels import reference  # noqa: E402
from kvpilot.kernels.cache import write_kv_cache  # noqa: E402
from kvpilot.kernels.kv_quant import FP8, dequantize, quantize  # noqa: E402
from kvpilot.kernels.paged_attention import paged_attention_with  # noqa: E402
from kvpilot.kernels.rotary import rotary_and_write_kv  # noqa: E402
from kvpilot.runtime.tunables import BLOCK_SIZES  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SCALE = HEAD_DIM ** -0.5
SCALES = (0.021, 0.0093)  # (k, v): typical of a calibrated model's layers, and unequal
LAYERS, READ_SEQS, READ_CTX = 32, 256, 1024
DEVICE, DTYPE = "cuda", torch.bfloat16  # the model's dtype: queries, keys and values before the cache
WRITE_TOKENS = 4096


def attention_batches(block_size: int) -> dict[str, list[tuple[int, int]]]:
    """(context, new tokens) per sequence: 24 decodes up to 3,000 tokens; 12 of them beside a
    prefill, a long chunked prefill and a short one."""
    rng = random.Random(block_size)
    decode = [(rng.randrange(1, 3000), 1) for _ in range(24)]
    return {"decode": decode, "mixed": decode[:12] + [(1024, 1024), (4096 + 512, 512), (700, 300)]}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.isnan().any():
        return math.inf
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def head_major(num_blocks: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    return reference.kv_cache_empty(num_blocks, block_size, KV_HEADS, HEAD_DIM, head_major=True, dtype=dtype,
                                    device=DEVICE)


def paged_batch(specs: list[tuple[int, int]], block_size: int, rng: random.Random) -> tuple[Any, ...]:
    """bf16 q, FP8 head-major caches (NaN in every slot outside a context), block tables in random
    order, seq_lens and query_start_loc; and the same with the caches de-quantised to bf16 (zero
    outside the contexts: the reference's masked scores would still multiply a NaN)."""
    per_seq = [-(-ctx // block_size) for ctx, _ in specs]
    num_blocks = sum(per_seq) + 2
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = torch.full((len(specs), max(per_seq) + 1), num_blocks - 1, dtype=torch.int32)
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    used = 0
    for i, ((ctx, _), n) in enumerate(zip(specs, per_seq, strict=True)):
        tables[i, :n] = torch.tensor(pool[used:used + n])
        used += n
        slots = tables[i, :n].long()[:, None] * block_size + torch.arange(block_size)
        live[slots.flatten()[:ctx]] = True
    scales = torch.tensor(SCALES, device=DEVICE)
    caches = []
    for scale in scales:
        values = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, device=DEVICE) * 2
        values.view(-1, KV_HEADS, HEAD_DIM)[~live.to(DEVICE)] = float("nan")
        cache = head_major(num_blocks, block_size, FP8)
        cache.copy_(quantize(values, scale))
        caches.append(cache)
    q = torch.randn(sum(n for _, n in specs), HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    qsl = torch.tensor([0] + [n for _, n in specs]).cumsum(0).int().to(DEVICE)
    seq_lens = torch.tensor([ctx for ctx, _ in specs], dtype=torch.int32, device=DEVICE)
    dequantised = [dequantize(c, s, DTYPE).nan_to_num(0.0) for c, s in zip(caches, scales, strict=True)]
    return (q, *caches, tables.to(DEVICE), seq_lens, qsl), scales, (q, *dequantised, tables.to(DEVICE), seq_lens, qsl)


def check_attention(block_size: int, rows: list[dict[str, Any]]) -> None:
    rng = random.Random(block_size)
    for kind, specs in attention_batches(block_size).items():
        batch, scales, plain = paged_batch(specs, block_size, rng)
        ref = reference.paged_attention(*plain, SCALE)
        hint = max(n for _, n in specs)
        paths: dict[str, dict[str, Any]] = {
            "pointer": {"max_query_len": hint, "num_splits": 1},
            "pointer split-KV x8": {"max_query_len": hint, "num_splits": 8},
        }
        if kind == "decode":
            paths["pointer MULTI (no max_query_len)"] = {}
        if block_size in (16, 32):
            paths["TMA decode"] = {"max_query_len": hint, "num_splits": 1, "use_tma": True}
        for path, knobs in paths.items():
            out = paged_attention_with(*batch, SCALE, kv_scales=scales, **knobs)
            err = rel(out, ref)
            name = f"{kind}: {path}" + (" + prefill" if kind == "mixed" else "")
            rows.append({"check": name, "block_size": block_size, "rel_err": err, "ok": err < 1.5e-2})
            print(json.dumps(rows[-1]), flush=True)


def check_writes(block_size: int, rows: list[dict[str, Any]]) -> None:
    num_tokens = WRITE_TOKENS
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE) * 4
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    num_blocks = 2 * num_tokens // block_size + 1
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[::97] = -1
    scales = torch.tensor(SCALES, device=DEVICE)
    caches = [head_major(num_blocks, block_size, FP8) for _ in range(2)]
    expected = [c.clone() for c in caches]
    reference.write_kv_cache(k, v, *expected, slots, kv_scales=scales)
    write_kv_cache(k, v, *caches, slots, scales)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(caches, expected, strict=True))
    rows.append({"check": "cache write (bytes equal torch's cast)", "block_size": block_size, "ok": same})
    inv_freq = 1.0 / (500000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.arange(8192, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(DEVICE)
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    ref_q, ref_k = q.clone(), k.clone()
    reference.rotary_embedding(positions, ref_q, ref_k, cos_sin)
    expected = [c.clone() for c in caches]
    reference.write_kv_cache(ref_k, v, *expected, slots, kv_scales=scales)
    rotary_and_write_kv(positions, q, k, cos_sin, v, *caches, slots, scales)
    # the rotation may round differently from the reference's in bf16: within one e4m3 step
    worst = max(((dequantize(a, s, torch.float32) - dequantize(b, s, torch.float32)).abs()
                 / dequantize(b, s, torch.float32).abs().clamp(min=s.item())).max().item()
                for a, b, s in zip(caches, expected, scales, strict=True))
    rows.append({"check": "fused rotary + cache write (within one e4m3 step)", "block_size": block_size,
                 "max_step": worst, "ok": worst <= 0.125})
    for row in rows[-2:]:
        print(json.dumps(row), flush=True)


def replay_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """fn captured into a CUDA graph; the median device time of `reps` replays."""
    graph = captured(fn)
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    del graph
    return statistics.median(times)


def kv_read(dtype: torch.dtype, rate: float) -> list[dict[str, Any]]:
    """32 layers' decode attention over 256 x 1,024 tokens of `dtype` caches in one graph."""
    block_size = 16
    per_seq = READ_CTX // block_size
    num_blocks = READ_SEQS * per_seq
    tables = torch.randperm(num_blocks, device=DEVICE).int().view(READ_SEQS, per_seq)
    seq_lens = torch.full((READ_SEQS,), READ_CTX, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(READ_SEQS + 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(READ_SEQS, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scales = torch.tensor(SCALES, device=DEVICE) if dtype == FP8 else None
    layers = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            cache = head_major(num_blocks, block_size, dtype)
            if dtype == FP8:
                cache.view(torch.uint8).random_(0, 0x70)  # finite, positive e4m3 codes
            else:
                cache.normal_()
            pair.append(cache)
        layers.append(pair)
    kv_bytes = LAYERS * 2 * num_blocks * block_size * KV_HEADS * HEAD_DIM * dtype.itemsize

    def decode_all(use_tma: bool | None) -> None:
        for k_cache, v_cache in layers:
            paged_attention_with(q, k_cache, v_cache, tables, seq_lens, qsl, SCALE, max_query_len=1, out=out,
                                 use_tma=use_tma, kv_scales=scales)

    rows = []
    for kernel, tma in (("TMA (the engine's decode graphs)", True), ("pointer", False)):
        ms = replay_ms(partial(decode_all, None if tma else False))
        rows.append({"kv_read": str(dtype).removeprefix("torch."), "kernel": kernel, "ms": ms,
                     "kv_GB": kv_bytes / 1e9, "TBps": kv_bytes / ms / 1e9, "floor_ms": kv_bytes / rate * 1e3})
        print(json.dumps(rows[-1]), flush=True)
    layers.clear()
    torch.cuda.empty_cache()
    return rows


def engine_step(kv_cache_dtype: str) -> dict[str, Any]:
    """In this process: the engine run of part 3 for one cache dtype."""
    from kvpilot.runtime import LLM, SamplingParams

    engine_bench.NEW_TOKENS = 128
    started = time.perf_counter()
    llm = LLM("llama-3-8b", load_format="dummy", device=DEVICE, max_model_len=1200, max_num_seqs=256,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.9, kv_cache_dtype=kv_cache_dtype)
    start_s = time.perf_counter() - started
    rng = random.Random(0)
    llm.generate([{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(960)]}],
                 SamplingParams(max_tokens=4))
    layout = llm.engine.runner.layout
    spans = engine_bench.timed_forward(llm.engine.runner)
    clock = engine_bench.ClockLog()
    prompts = [[rng.randrange(1000, 100000) for _ in range(960)] for _ in range(256)]
    row = engine_bench.decode_steps(llm, prompts, spans, f"kv-{kv_cache_dtype}", clock)
    clock.close()
    result = {"kv_cache_dtype": kv_cache_dtype, "engine_start_s": start_s, "kv_capacity_tokens": layout.capacity_tokens,
              "kv_bytes_per_token": layout.bytes_per_token, "num_blocks": layout.num_blocks,
              "kv_scales": llm.engine.runner.kv_scales_source, **row}
    print(json.dumps(result), flush=True)
    return result


def engine_in_subprocess(kv_cache_dtype: str) -> dict[str, Any]:
    """Each engine in its own process, so each sizes its cache on an empty GPU."""
    proc = subprocess.run([sys.executable, __file__, "--engine", kv_cache_dtype], capture_output=True, text=True,
                          check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the {kv_cache_dtype} engine run failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(lines[-1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="a folder for bench_kv_fp8.json")
    parser.add_argument("--skip-engine", action="store_true", help="kernels only (no engine starts)")
    parser.add_argument("--engine", choices=("auto", "fp8"), help=argparse.SUPPRESS)  # part 3, one dtype
    args = parser.parse_args()
    if args.engine:
        engine_step(args.engine)
        return
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps(head), flush=True)
    torch.manual_seed(0)
    checks: list[dict[str, Any]] = []
    for block_size in BLOCK_SIZES:
        check_writes(block_size, checks)
        check_attention(block_size, checks)
    rate = engine_bench.copy_rate()
    reads = kv_read(torch.bfloat16, rate) + kv_read(FP8, rate)
    engines = [] if args.skip_engine else [engine_in_subprocess("auto"), engine_in_subprocess("fp8")]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_kv_fp8.json").write_text(json.dumps(
            {**head, "copy_TBps": rate / 1e12, "checks": checks, "kv_read": reads, "engine": engines}, indent=1))
    failed = [c for c in checks if not c["ok"]]
    print(f"\n{head['gpu']}, copy rate {rate / 1e12:.2f} TB/s")
    print(f"correctness: {len(checks) - len(failed)} of {len(checks)} checks pass; worst attention rel_err "
          f"{max(c.get('rel_err', 0) for c in checks):.2e}")
    for c in failed:
        print("  FAILED", json.dumps(c))
    print(f"{'KV read, 32 layers x 256 x 1,024 tokens':44s} {'ms':>7s} {'TB/s':>6s}")
    for r in reads:
        print(f"{r['kv_read'] + ', ' + r['kernel']:44s} {r['ms']:7.2f} {r['TBps']:6.2f}")
    for kernel in ("TMA (the engine's decode graphs)", "pointer"):
        ms = {r["kv_read"]: r["ms"] for r in reads if r["kernel"] == kernel}
        print(f"  fp8 / bf16, {kernel}: {ms['float8_e4m3fn'] / ms['bfloat16']:.2f}")
    if engines:
        print(f"{'engine, batch 256, context ~1,024':34s} {'step ms':>8s} {'out tok/s':>10s} {'KV tokens':>10s}")
        for e in engines:
            print(f"{'bf16 weights, KV ' + e['kv_cache_dtype']:34s} {e['decode_step_ms']:8.2f} {e['output_tok_s']:10.0f} "
                  f"{e['kv_capacity_tokens']:10d}")
        print(f"  fp8 KV step / bf16 KV step: {engines[1]['decode_step_ms'] / engines[0]['decode_step_ms']:.2f}; "
              f"capacity x{engines[1]['kv_capacity_tokens'] / engines[0]['kv_capacity_tokens']:.2f}")


if __name__ == "__main__":
    main()
