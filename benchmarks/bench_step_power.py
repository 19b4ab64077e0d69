"""The decode step's two large parts alone, under sustained load, with the GPU's clock and power:
why the batch-256 step of a Llama-3-8B-shaped model is slower than its bandwidth floor on an H200.

Three phases, each replayed back to back for --seconds from CUDA graphs while `nvidia-smi` samples
the SM clock, power draw and throttle reasons every 100 ms (bench_engine_gpu.ClockLog):

  gemms      the step's matrix products at M = batch: bench_gemm_decode.SHAPES, 32 layers of qkv,
             o, gate/up and down plus the LM head, each launch on its own weight (F.linear)
  attention  32 launches of the engine's decode attention (the TMA kernel where the GPU has it)
             over `batch` sequences of --context tokens in 16-token blocks, head-major caches
  both       the two graphs alternating: a step without its small kernels (norms, SiLU x up,
             rotary, cache writes, sampling) and the gaps between kernels

Per phase: the median and fastest replay (ms), the SM clock (median, lowest), the median power,
the share of samples slowed by the power cap; attention's KV read rate; two ceilings measured in
the same run: a 1 GiB device-to-device copy (bytes read + written, the rate bench_engine_gpu's
floor uses) and a 4 GiB bf16 sum (bytes read); and the step's bandwidth floor as
bench_engine_gpu.py counts it (the products' weights and the KV over the copy rate).

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_step_power.py [--batch 256] [--context 1024]
                 [--seconds 4] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks below
from bench_engine_gpu import ClockLog, copy_rate  # noqa: E402
from bench_gemm_decode import HEAD_DIM, HEADS, KV_HEADS, LAYERS, SHAPES, captured  # noqa: E402

from kvpilot.kernels.paged_attention import paged_attention_with  # noqa: E402
from kvpilot.kernels.reference import kv_cache_empty  # noqa: E402

BLOCK_SIZE = 16


def gemm_graph(batch: int) -> torch.cuda.CUDAGraph:
    launches = []
    for k, n, count in SHAPES.values():
        x = torch.randn(batch, k, dtype=torch.bfloat16, device="cuda")
        launches += [(x, torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5) for _ in range(count)]

    def products() -> None:
        for x, w in launches:
            F.linear(x, w)
    return captured(products)


def attention_graph(batch: int, context: int) -> tuple[torch.cuda.CUDAGraph, int]:
    """32 launches over one layer's caches (1 GiB at batch 256, context 1,024: far past the L2),
    and the KV bytes they read."""
    blocks = batch * -(-context // BLOCK_SIZE)
    k_cache, v_cache = (kv_cache_empty(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, head_major=True, dtype=torch.bfloat16,
                                       device="cuda").normal_() for _ in range(2))
    tables = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, -1)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")

    def launches() -> None:
        for _ in range(LAYERS):
            paged_attention_with(q, k_cache, v_cache, tables, lens, starts, HEAD_DIM ** -0.5, max_query_len=1,
                                 use_tma=None, out=out)
    return captured(launches), LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * 2


def sustain(name: str, graphs: list[torch.cuda.CUDAGraph], seconds: float, clock: ClockLog) -> dict[str, object]:
    """Replays the graphs back to back for `seconds`; the replays' times (the first quarter, while
    the clock settles, left out of the median) and the clock over all but the first 0.5 s."""
    torch.cuda.synchronize()
    times = []
    begin = time.time()
    while time.time() - begin < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for graph in graphs:
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    finish = time.time()
    time.sleep(0.3)  # the sampler's last lines
    row = {"phase": name, "replays": len(times), "ms": statistics.median(times[len(times) // 4:]),
           "fastest_ms": min(times), **clock.window(begin + 0.5, finish)}
    print(json.dumps(row), flush=True)
    time.sleep(2.0)  # idle between phases, so each starts from a cool card
    return row


def read_rate() -> float:
    """Bytes read per second by a float32-accumulated sum of 4 GiB of bf16."""
    import triton

    x = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").normal_()
    ms = triton.testing.do_bench(lambda: x.sum(dtype=torch.float32), warmup=20, rep=300, return_mode="median")
    return x.numel() * 2 / (ms * 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--seconds", type=float, default=4.0, help="each phase's length")
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_power.py times CUDA kernels: no GPU here")
    ceilings = {"copy_TBps": copy_rate() / 1e12, "read_TBps": read_rate() / 1e12}
    print(json.dumps(ceilings), flush=True)
    gemms = gemm_graph(args.batch)
    attention, kv_bytes = attention_graph(args.batch, args.context)
    clock = ClockLog()
    try:
        rows = [sustain("gemms", [gemms], args.seconds, clock),
                sustain("attention", [attention], args.seconds, clock),
                sustain("both", [gemms, attention], args.seconds, clock)]
    finally:
        clock.close()
    weight_bytes = sum(2 * k * n * count for k, n, count in SHAPES.values())
    attention_rate = {"attention_kv_TBps": kv_bytes / (rows[1]["ms"] * 1e-3) / 1e12,  # type: ignore[operator]
                      "step_floor_ms": (weight_bytes + kv_bytes) / (ceilings["copy_TBps"] * 1e12) * 1e3}
    print(json.dumps(attention_rate), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "batch": args.batch, "context": args.context, **ceilings,
                                        **attention_rate, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
