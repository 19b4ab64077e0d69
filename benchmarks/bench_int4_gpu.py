"""Integer (AWQ/GPTQ) weights on the GPU: the kernels' correctness at real sizes, their speed against
the bandwidth floor of their packed bytes and against bf16, and the engine with int4 weights beside
bf16 (and FP8 with --fp8), all Llama-3-8B-shaped, re-measured in one run.

Parts, in order (each prints JSON lines; the table at the end sums them up):
  check    kvpilot.kernels.int_gemm.int_gemm against de-quantise-then-matmul (float32) for the four
           projections at M = 1, 16, 64, 256, 2048: 4-bit group 128, and 4-bit act-order and 8-bit at
           M = 16 and 256; the largest difference over the largest output
  decode   the decode kernels at M = 1, 2, 4, 8, 16, per projection: 32 launches each on its own
           layer's weights (none stays in L2) replayed from one CUDA graph, microseconds a launch,
           and the floor: the bytes a launch must read and write (packed weights, scales, zeros,
           activations) over the copy rate measured in the same run; the launcher's choice (the
           4-bit kernel, decode_int4.py), the older decode.py kernel (old_us) and bf16 F.linear
           beside it; and per M the decode step's 128 projections together. --sweep also tries the
           4-bit kernel's variants per shape at M = 1, 4 and 16, each checked against the float32
           reference before it is timed (one that fails to compile or to match is recorded and
           skipped): first its structures (K order, orientation, inline PTX, x's row sums) at the
           default tile, then, for the two best, block_n x (warps, stages) x split_k; the best
           against the launcher's choice, and the sweep's every timing in the JSON
  prefill  the tiled kernel at M = 256, 2048, 8192 against bf16 F.linear (TFLOP/s), and the torch
           twin (de-quantise the whole weight, then bf16 F.linear) beside them
  engine   LLM("llama-3-8b", load_format="dummy") for bf16 and awq (and fp8), each in its own
           process: one stream's ms per output token (batch 1, prompt 512, 128 new tokens), the
           batch-256 decode step at context ~1,024 (prompt 960, 128 new), and offline
           1,000 x (256 in, 256 out) total tokens/s. GPTQ weights take the same layout and kernels
           as AWQ's once loaded (without act-order), so awq stands for both

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_int4_gpu.py --out DIR [--sweep [--sweep-budget S]] [--fp8]
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
from kvpilot.kernels.int_gemm.decode_int4 import Int4DecodeConfig  # noqa: E402
from kvpilot.kernels.int_gemm.launcher import choose_decode, choose_int4_decode  # noqa: E402

PROJECTIONS = {name: SHAPES[name] for name in ("qkv", "o", "gate_up", "down")}
GROUP = 128
SWEEP_MS = (1, 4, 16)
STRUCTURES = [dict(order=order, swap=swap, asm=asm, sum_dot=sum_dot, block_n=64 if swap else 32)
              for order in (0, 1, 2) for swap in (True, False) for sum_dot in (False, True)
              for asm in (True, False) if asm or (order == 1 and swap and not sum_dot)]
TILES = [dict(block_n=bn, num_warps=w, num_stages=st) for bn in (64, 128, 32)  # likelier first: the budget may cut
         for w, st in ((4, 4), (4, 6), (4, 3), (8, 4), (4, 2))]
SPLITS = (1, 2, 4, 8)


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


def decode(rate: float, sweep: bool, budget_s: float) -> list[dict[str, Any]]:
    rows = []
    end = time.perf_counter() + budget_s
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i, (name, (k, n, count)) in enumerate(PROJECTIONS.items()):
        weights = [random_weight(n, k) for _ in range(count)]
        dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5 for _ in range(count)]
        deadline = time.perf_counter() + (end - time.perf_counter()) / (len(PROJECTIONS) - i)  # an equal share left
        best_by_m = sweep_shape(name, weights, rate, num_sms, deadline, rows) if sweep else {}
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            floor_us = floor(weights[0], m, rate)
            config = choose_int4_decode(m, weights[0], num_sms)
            old = choose_decode(m, weights[0], num_sms)
            us = graph_us([lambda w=w, x=x: int_gemm_decode(x, w) for w in weights])
            old_us = graph_us([lambda w=w, x=x, old=old: int_gemm_decode(x, w, old) for w in weights])
            bf16_us = graph_us([lambda w=w, x=x: F.linear(x, w) for w in dense])
            row = {"part": "decode", "shape": name, "m": m, "us": us, "floor_us": floor_us, "of_floor": floor_us / us,
                   "old_us": old_us, "old_of_floor": floor_us / old_us, "bf16_us": bf16_us,
                   "speedup_vs_bf16": bf16_us / us, "config": config.__dict__, "old_config": old.__dict__}
            if m in best_by_m:
                best_us, best = best_by_m[m]
                row.update(best_us=best_us, best_of_floor=floor_us / best_us, best_config=best.__dict__)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del weights, dense
        torch.cuda.empty_cache()
    for m in sorted({r["m"] for r in rows if r["part"] == "decode"}):  # a decode step's 32 layers of the four projections
        per = [(r, PROJECTIONS[r["shape"]][2]) for r in rows if r["part"] == "decode" and r["m"] == m]
        step = {key: sum(r[key] * count for r, count in per) / 1e3 for key in ("us", "old_us", "floor_us", "bf16_us")}
        rows.append({"part": "decode_step", "m": m, "ms": step["us"], "floor_ms": step["floor_us"],
                     "of_floor": step["floor_us"] / step["us"], "old_ms": step["old_us"], "bf16_ms": step["bf16_us"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def floor(w: IntWeight, m: int, rate: float) -> float:
    """Microseconds to read the packed weights, scales, zeros and activations and write the output."""
    n, k = w.out_features, w.in_features
    return (packed_bytes(w) + 2 * m * (k + n)) / rate * 1e6


def sweep_shape(name: str, weights: list[IntWeight], rate: float, num_sms: int, deadline: float,
                rows: list[dict[str, Any]]) -> dict[int, tuple[float, Int4DecodeConfig]]:
    """The 4-bit kernel's variants on one shape: structures first, then tiles and splits for the two
    best structures (while the budget lasts). Returns the best (us, config) per M in SWEEP_MS."""
    k = weights[0].in_features
    xs = {m: torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for m in SWEEP_MS}
    wide = IntWeight(weights[0].qweight, weights[0].scales.float(), weights[0].zeros.float(), 4, GROUP)
    expected = {m: int_linear_reference(x.float(), wide) for m, x in xs.items()}
    default_split = choose_int4_decode(1, weights[0], num_sms).split_k
    results: list[tuple[float, int, Int4DecodeConfig]] = []

    def attempt(config: Int4DecodeConfig, stage: str) -> float | None:
        """Sum over SWEEP_MS of us / floor (None if it failed); every outcome becomes a row."""
        total = 0.0
        for m, x in xs.items():
            row: dict[str, Any] = {"part": "decode_sweep", "shape": name, "m": m, "stage": stage,
                                   "config": config.__dict__}
            try:
                out = int_gemm_decode(x, weights[0], config).float()  # compiles outside any capture
                diff = float((out - expected[m]).abs().max() / expected[m].abs().max())
                row["max_diff_of_max"] = diff
                if not diff <= 0.01:
                    raise ValueError(f"differs from the reference by {diff:.4f} of its largest output")
                us = graph_us([lambda w=w, x=x: int_gemm_decode(x, w, config) for w in weights])
            except Exception as error:  # a variant that fails to compile, launch or match: record, go on
                row["error"] = f"{type(error).__name__}: {error}"[:500]
                rows.append(row)
                print(json.dumps(row), flush=True)
                return None
            row.update(us=us, of_floor=floor(weights[0], m, rate) / us)
            rows.append(row)
            results.append((us, m, config))
            total += 1 / row["of_floor"]
        return total

    scored = []
    for structure in STRUCTURES:
        config = Int4DecodeConfig(split_k=default_split, **structure)
        score = attempt(config, "structure")
        if score is not None:
            scored.append((score, structure))
    tiles = [Int4DecodeConfig(split_k=split, **{**structure, **tile})
             for _, structure in sorted(scored, key=lambda t: t[0])[:2] for tile in TILES for split in SPLITS
             if k % (split * Int4DecodeConfig.block_k) == 0]
    for i, config in enumerate(tiles):
        if time.perf_counter() > deadline:
            rows.append({"part": "decode_sweep", "shape": name, "stage": "tiles",
                         "error": f"budget spent: {len(tiles) - i} of {len(tiles)} tile variants not tried"})
            break
        attempt(config, "tiles")
    best = {}
    for m in SWEEP_MS:
        timed = [(us, config) for us, mm, config in results if mm == m]
        if timed:
            best[m] = min(timed, key=lambda t: t[0])
            summary = {"part": "decode_sweep_best", "shape": name, "m": m, "us": best[m][0],
                       "of_floor": floor(weights[0], m, rate) / best[m][0], "config": best[m][1].__dict__,
                       "tried": len(timed)}
            rows.append(summary)
            print(json.dumps(summary), flush=True)
    return best


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
                     f"({r['floor_us']:.1f} us)  old {r['old_us']:7.1f} us {r['old_of_floor']:.0%}  "
                     f"bf16 {r['bf16_us']:7.1f} us  x{r['speedup_vs_bf16']:.2f}{best}")
    for r in (r for r in rows if r["part"] == "decode_step"):
        lines.append(f"decode step's projections M={r['m']:<3d} {r['ms']:.3f} ms  {r['of_floor']:.0%} of floor "
                     f"({r['floor_ms']:.3f} ms)  old {r['old_ms']:.3f} ms  bf16 {r['bf16_ms']:.3f} ms")
    failed = [r for r in rows if r["part"] == "decode_sweep" and "error" in r]
    if any(r["part"] == "decode_sweep" for r in rows):
        lines.append(f"sweep: {len(failed)} variant timings failed or were cut (see JSON)")
    for r in (r for r in rows if r["part"] == "decode_sweep_best"):
        c = r["config"]
        lines.append(f"sweep best {r['shape']:8s} M={r['m']:<3d} {r['us']:7.1f} us  {r['of_floor']:.0%} of floor  "
                     f"order {c['order']} swap {c['swap']} asm {c['asm']} sum_dot {c['sum_dot']} block_n {c['block_n']} "
                     f"split {c['split_k']} warps {c['num_warps']} stages {c['num_stages']}  ({r['tried']} tried)")
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
    parser.add_argument("--sweep", action="store_true", help="also time the 4-bit decode kernel's variants per shape")
    parser.add_argument("--sweep-budget", type=float, default=130.0,
                        help="seconds the decode part may take before the sweep stops trying tiles (each shape's "
                             "structure stage always runs)")
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
        rows += decode(rate, args.sweep, args.sweep_budget)
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
