"""Integer (AWQ/GPTQ) weights on the GPU: the kernels' correctness at real sizes, their speed against
the bandwidth floor of their packed bytes and against bf16, and the engine with int4 weights beside
bf16 (and FP8 with --fp8), all Llama-3-8B-shaped, re-measured in one run.

Parts, in order (each prints JSON lines; the table at the end sums them up):
  check    kvpilot.kernels.int_gemm.int_gemm against de-quantise-then-matmul (float32) for the four
           projections at M = 1, 16, 64, 256, 2048: 4-bit group 128, and 4-bit act-order and 8-bit at
           M = 16 and 256; the largest difference over the largest output
  decode   the decode kernel at M = 1, 2, 4, 8, 16, per projection: 32 launches each on its own
           layer's weights (none stays in L2) replayed from one CUDA graph, microseconds a launch,
           and the floor: the bytes a launch must read and write (packed weights, scales, zeros,
           activations) over the copy rate measured in the same run; bf16 F.linear beside it; and
           per M the decode step's 128 projections together. --sweep also times a grid of tiles
           per shape at M = 1 and 16 (the best against the launcher's choice)
  prefill  the tiled kernel at M = 256, 2048, 8192 against bf16 F.linear (TFLOP/s), and the torch
           twin (de-quantise the whole weight, then bf16 F.linear) beside them
  engine   LLM("llama-3-8b", load_format="dummy") for bf16 and awq (and fp8), each in its own
           process: one stream's ms per output token (batch 1, prompt 512, 128 new tokens), the
           batch-256 decode step at context ~1,024 (prompt 960, 128 new), and offline
           1,000 x (256 in, 256 out) total tokens/s. GPTQ weights take the same layout and kernels
           as AWQ's once loaded (without act-order), so awq stands for both

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_int4_gpu.py --out DIR [--sweep] [--fp8]
                 [--parts check decode prefill engine]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks below
from bench_engine_gpu import ClockLog, copy_rate, decode_steps, timed_forward  # noqa: E402
from bench_gemm_decode import SHAPES, graph_us  # noqa: E402

from kvpilot.kernels.int_gemm import (  # noqa: E402
    IntWeight,
    int_gemm,
    int_gemm_decode,
    int_gemm_prefill,
    int_linear_reference,
    pack_rows,
)
from kvpilot.kernels.int_gemm.decode import DecodeConfig  # noqa: E402
from kvpilot.kernels.int_gemm.launcher import choose_decode  # noqa: E402

PROJECTIONS = {name: SHAPES[name] for name in ("qkv", "o", "gate_up", "down")}
GROUP = 128
SWEEP = [DecodeConfig(block_n=bn, block_k=bk, split_k=s, num_warps=w, num_stages=st)
         for bn in (16, 32, 64) for bk in (64, 128) for s in (1, 2) for w, st in ((4, 4), (4, 2))]


def random_weight(n: int, k: int, bits: int = 4, act_order: bool = False) -> IntWeight:
    q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.int32, device="cuda")
    groups = k // GROUP
    scales = (torch.rand(groups, n, device="cuda") * 2e-3 + 1e-4).to(torch.bfloat16)
    zeros = torch.randint(0, 2 ** bits, (groups, n), device="cuda").to(torch.bfloat16)
    perm = torch.randperm(k, device="cuda").to(torch.int32) if act_order else None
    return IntWeight(pack_rows(q, bits), scales, zeros, bits, GROUP, perm)


def packed_bytes(w: IntWeight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros))


def check() -> list[dict[str, Any]]:
    rows = []
    for name, (k, n, _) in PROJECTIONS.items():
        cases = [(m, 4, False) for m in (1, 16, 64, 256, 2048)] + [(16, 4, True), (256, 4, True), (16, 8, False),
                                                                    (256, 8, False)]
        for m, bits, act_order in cases:
            w = random_weight(n, k, bits, act_order)
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            wide = IntWeight(w.qweight, w.scales.float(), w.zeros.float(), bits, GROUP, w.perm)
            expected = int_linear_reference(x.float(), wide)
            diff = float((int_gemm(x, w).float() - expected).abs().max() / expected.abs().max())
            rows.append({"part": "check", "shape": name, "m": m, "bits": bits, "act_order": act_order,
                         "max_diff_of_max": diff, "ok": diff <= 0.02})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def decode(rate: float, sweep: bool) -> list[dict[str, Any]]:
    rows = []
    for name, (k, n, count) in PROJECTIONS.items():
        weights = [random_weight(n, k) for _ in range(count)]
        dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5 for _ in range(count)]
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            floor_us = (packed_bytes(weights[0]) + 2 * m * (k + n)) / rate * 1e6
            us = graph_us([lambda w=w, x=x: int_gemm_decode(x, w) for w in weights])
            bf16_us = graph_us([lambda w=w, x=x: F.linear(x, w) for w in dense])
            config = choose_decode(m, weights[0], torch.cuda.get_device_properties(0).multi_processor_count)
            row = {"part": "decode", "shape": name, "m": m, "us": us, "floor_us": floor_us, "of_floor": floor_us / us,
                   "bf16_us": bf16_us, "speedup_vs_bf16": bf16_us / us, "config": config.__dict__}
            if sweep and m in (1, 16):
                timed = [(graph_us([lambda w=w, c=c, x=x: int_gemm_decode(x, w, c) for w in weights]), c) for c in SWEEP
                         if k % (c.split_k * c.block_k) == 0]
                best_us, best = min(timed, key=lambda t: t[0])
                row.update(best_us=best_us, best_of_floor=floor_us / best_us, best_config=best.__dict__)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del weights, dense
        torch.cuda.empty_cache()
    for m in sorted({r["m"] for r in rows}):  # a decode step's 32 layers of the four projections
        per = [(r, PROJECTIONS[r["shape"]][2]) for r in rows if r["m"] == m]
        step = {key: sum(r[key] * count for r, count in per) / 1e3 for key in ("us", "floor_us", "bf16_us")}
        rows.append({"part": "decode_step", "m": m, "ms": step["us"], "floor_ms": step["floor_us"],
                     "of_floor": step["floor_us"] / step["us"], "bf16_ms": step["bf16_us"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def timed_ms(fn: Callable[[], object]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))


def prefill() -> list[dict[str, Any]]:
    rows = []
    for name, (k, n, _) in PROJECTIONS.items():
        w = random_weight(n, k)
        dense = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
        for m in (256, 2048, 8192):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ms = timed_ms(lambda x=x, w=w: int_gemm_prefill(x, w))
            bf16_ms = timed_ms(lambda x=x, dense=dense: F.linear(x, dense))
            twin_ms = timed_ms(lambda x=x, w=w: int_linear_reference(x, w))
            flop = 2 * m * n * k
            rows.append({"part": "prefill", "shape": name, "m": m, "ms": ms, "tflops": flop / ms / 1e9,
                         "bf16_ms": bf16_ms, "bf16_tflops": flop / bf16_ms / 1e9, "of_bf16": bf16_ms / ms,
                         "twin_ms": twin_ms})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def engine_variant(quantization: str | None) -> dict[str, Any]:
    """One engine's figures (run in a process of its own: each engine takes most of the GPU)."""
    from kvpilot.runtime import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM("llama-3-8b", load_format="dummy", quantization=quantization, device="cuda", max_model_len=1280,
              max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9)
    out: dict[str, Any] = {"part": "engine", "quantization": quantization or "bf16",
                           "start_s": time.perf_counter() - started,
                           "weight_bytes": llm.engine.runner.model.streamed_weight_bytes()}
    spans = timed_forward(llm.engine.runner)
    rng = random.Random(0)

    def prompts(batch: int, length: int) -> list[list[int]]:
        return [[rng.randrange(1000, 100000) for _ in range(length)] for _ in range(batch)]

    clock = ClockLog()
    one = decode_steps(llm, prompts(1, 512), spans, "one", clock)  # 128 new tokens (bench_engine_gpu.NEW_TOKENS)
    out["one_stream_ms_per_token"] = one["decode_step_ms"]
    big = decode_steps(llm, prompts(256, 960), spans, "b256", clock)
    out["batch256_step_ms"] = big["decode_step_ms"]
    out["batch256_sm_clock_mhz"] = big["sm_clock_mhz"]
    clock.close()
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(1000, 256)]
    torch.cuda.synchronize()
    begin = time.perf_counter()
    llm.generate(batch, params)
    out["offline_total_tok_s"] = 1000 * 512 / (time.perf_counter() - begin)
    return out


def engine(variants: list[str]) -> list[dict[str, Any]]:
    rows = []
    for variant in variants:
        proc = subprocess.run([sys.executable, __file__, "--engine-variant", variant], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "part": "engine", "quantization": variant, "error": proc.stderr[-2000:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = []
    checks = [r for r in rows if r["part"] == "check"]
    if checks:
        worst = max(r["max_diff_of_max"] for r in checks)
        lines.append(f"check: {sum(r['ok'] for r in checks)}/{len(checks)} within 2% (worst {worst:.4f})")
    for r in (r for r in rows if r["part"] == "decode"):
        best = f"  sweep best {r['best_of_floor']:.0%}" if "best_of_floor" in r else ""
        lines.append(f"decode {r['shape']:8s} M={r['m']:<3d} {r['us']:7.1f} us  {r['of_floor']:.0%} of floor "
                     f"({r['floor_us']:.1f} us)  bf16 {r['bf16_us']:7.1f} us  x{r['speedup_vs_bf16']:.2f}{best}")
    for r in (r for r in rows if r["part"] == "decode_step"):
        lines.append(f"decode step's projections M={r['m']:<3d} {r['ms']:.3f} ms  {r['of_floor']:.0%} of floor "
                     f"({r['floor_ms']:.3f} ms)  bf16 {r['bf16_ms']:.3f} ms")
    for r in (r for r in rows if r["part"] == "prefill"):
        lines.append(f"prefill {r['shape']:8s} M={r['m']:<5d} {r['tflops']:6.0f} TFLOP/s  bf16 {r['bf16_tflops']:6.0f}"
                     f"  ({r['of_bf16']:.2f}x bf16's rate; de-quantise then bf16: {r['twin_ms']:.3f} ms)")
    for r in (r for r in rows if r["part"] == "engine"):
        if "error" in r:
            lines.append(f"engine {r['quantization']}: failed (see JSON)")
            continue
        lines.append(f"engine {r['quantization']:5s} one stream {r['one_stream_ms_per_token']:.2f} ms/token  batch-256 step "
                     f"{r['batch256_step_ms']:.2f} ms  offline 1000x256/256 {r['offline_total_tok_s']:,.0f} tok/s  "
                     f"weights {r['weight_bytes'] / 1e9:.2f} GB  start {r['start_s']:.0f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="folder for int4_gpu.json")
    parser.add_argument("--parts", nargs="+", default=["check", "decode", "prefill", "engine"],
                        choices=["check", "decode", "prefill", "engine"])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of decode tiles per shape")
    parser.add_argument("--fp8", action="store_true", help="an FP8-weights engine beside bf16 and awq")
    parser.add_argument("--engine-variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_int4_gpu.py times CUDA kernels: no GPU here")
    if args.engine_variant:
        print(json.dumps(engine_variant(None if args.engine_variant == "bf16" else args.engine_variant)), flush=True)
        return
    rate = copy_rate()
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_TBps": rate / 1e12}
    print(json.dumps(head), flush=True)
    rows: list[dict[str, Any]] = []
    if "check" in args.parts:
        rows += check()
    if "decode" in args.parts:
        rows += decode(rate, args.sweep)
    if "prefill" in args.parts:
        rows += prefill()
    if "engine" in args.parts:
        torch.cuda.empty_cache()  # each engine sizes its KV cache from the memory left free
        rows += engine(["bf16", "awq"] + (["fp8"] if args.fp8 else []))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "int4_gpu.json").write_text(json.dumps({**head, "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
