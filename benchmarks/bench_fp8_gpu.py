"""FP8 weights on the GPU, checked and timed in one run against bf16 re-measured beside them.

1. Correctness at the Llama-3-8B projection sizes: every FP8 product path (the engine's choice,
   cuBLASLt's `torch._scaled_mm`, the few-row Triton kernel) against de-quantise-then-bf16 (the
   FP8 activations and weights widened to bf16 and multiplied by `F.linear`), and the fused
   activation kernels (RMSNorm, residual add + RMSNorm, SiLU x up, plain) against the reference's
   quantization of the unfused op: share of identical FP8 values and scales.
2. The step's matrix products: 32 layers of qkv, o, gate/up and down with their norms and
   activation (each layer its own weights, so none stays in L2) plus the bf16 LM head (on up to 256
   rows: one per sequence), one CUDA graph per variant, at decode sizes M = 1..256 and prefill sizes up to 8192 tokens:
   bf16 (the engine's bf16 path), fp8 (the engine's FP8 path: quantization fused into the norms and
   the activation), fp8-unfused (per-token quantization by plain torch ops before cuBLASLt, the
   path the fusion replaces) and the bare products (cuBLASLt, and the Triton kernel at M <= 16).
   Rates: TFLOP/s against the card's dense FP8 peak and weight bytes against the copy rate.
3. The engine (Llama-3-8B shape, dummy weights, block 16, --max-num-seqs 256
   --max-num-batched-tokens 8192, decode CUDA graphs, async scheduling), each configuration in its
   own process: the decode step at batch 1 (one stream: ms per output token) and 256 with a
   context of ~1,024 tokens, and offline `LLM.generate` of 1,000 x (256 in, 256 out) as
   `kvpilot bench throughput` measures it; configurations bf16, fp8 and, where the engine has
   --kv-cache-dtype, fp8 with an FP8 KV cache.

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_fp8_gpu.py --out DIR
                 [--engines bf16 fp8 fp8-kv] [--skip-engines] [--skip-gemms] [--decode-sizes ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks below
from bench_engine_gpu import copy_rate  # noqa: E402
from bench_gemm_decode import HIDDEN, INTERMEDIATE, LAYERS, SHAPES, graph_us  # noqa: E402

from kvpilot.kernels import activation, fp8_gemv, fp8_quant, norm, reference  # noqa: E402
from kvpilot.runtime.executor.parallel import TPInfo  # noqa: E402
from kvpilot.runtime.executor.quant.base import Linear, QuantizedInput  # noqa: E402
from kvpilot.runtime.executor.quant.fp8 import Fp8Method, Fp8Scheme  # noqa: E402

DECODE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_SIZES = [512, 1024, 2048, 4096, 8192]
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# dense (no sparsity) tensor-core peaks in TFLOP/s, from NVIDIA's data sheets (SXM parts)
PEAKS = {"H100": {"fp8": 1979.0, "bf16": 989.4}, "H200": {"fp8": 1979.0, "bf16": 989.4}}
ENGINES = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8-kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
PROMPT_LEN, NEW_TOKENS = 960, 128  # a decode step's context ~1,024 tokens


class Source:
    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape = t, tuple(t.shape)

    def read(self, dim: int | None = None, start: int = 0, length: int = 0) -> torch.Tensor:
        return self.t if dim is None else self.t.narrow(dim, start, length)


def fp8_layer(weight: torch.Tensor) -> Linear:
    """The engine's FP8 linear layer on `weight` (bf16, quantized as a plain checkpoint is)."""
    with torch.device("cuda"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = Linear(weight.shape[1], [weight.shape[0]], bias=False, parallel="column", tp=TPInfo(),
                           method=Fp8Method(Fp8Scheme()))
        finally:
            torch.set_default_dtype(previous)
    layer.method.load(layer, "weight", Source(weight), "w", 0)
    return layer


def scaled_mm(x: QuantizedInput, layer: Linear) -> torch.Tensor:
    return torch._scaled_mm(x.data, layer.weight.t(), scale_a=x.scales, scale_b=layer.weight_scale.t(),
                            out_dtype=torch.bfloat16)


def gemv(x: QuantizedInput, layer: Linear) -> torch.Tensor:
    return fp8_gemv.fp8_gemv(x.data, x.scales, layer.weight, layer.weight_scale, None, torch.bfloat16)


def correctness() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    torch.manual_seed(0)
    for name in PROJECTIONS:
        k, n, _ = SHAPES[name]
        layer = fp8_layer(torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5)
        w_bf16 = layer.method.dequantized_weight(layer).to(torch.bfloat16)
        for m in (1, 16, 256, 2048):
            x = QuantizedInput(*reference.quantize_fp8(torch.randn(m, k, dtype=torch.bfloat16, device="cuda")))
            expected = F.linear(x.dequantize(torch.bfloat16), w_bf16).float()
            paths: dict[str, Callable[[QuantizedInput, Linear], torch.Tensor]] = {
                "engine": lambda x, lin: lin(x), "scaled_mm": scaled_mm}
            if m <= fp8_gemv.MAX_ROWS:
                paths["gemv"] = gemv
            for path, product in paths.items():
                got = product(x, layer).float()
                error = float((got - expected).abs().max() / expected.abs().max())
                rows.append({"shape": name, "m": m, "path": path, "max_rel_error": error, "ok": error < 2 ** -6})
    x = torch.randn(256, HIDDEN, dtype=torch.bfloat16, device="cuda")
    residual, weight = torch.randn_like(x), torch.randn(HIDDEN, dtype=torch.bfloat16, device="cuda")
    gate_up = torch.randn(256, 2 * INTERMEDIATE, dtype=torch.bfloat16, device="cuda") * 3
    fused = {
        "quantize": (fp8_quant.quantize_fp8(x, None), reference.quantize_fp8(x)),
        "rms_norm": (norm.rms_norm_fp8(x, weight, 1e-5, None),
                     reference.quantize_fp8(reference.rms_norm(x, weight, 1e-5))),
        "silu_and_mul": (fp8_quant.silu_and_mul_fp8(gate_up, None),
                         reference.quantize_fp8(reference.silu_and_mul(gate_up))),
        "add_rms_norm": (norm.fused_add_rms_norm_fp8(x, residual.clone(), weight, 1e-5, None),
                         reference.quantize_fp8(reference.rms_norm(residual + x, weight, 1e-5))),
    }
    for op, ((q, s), (ref_q, ref_s)) in fused.items():
        same = float((q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean())
        rows.append({"op": op, "identical_values": same, "identical_scales": float((s == ref_s).float().mean()),
                     "ok": same > 0.99})
    return rows


class StepProducts:
    """One decode/prefill step's linear layers (32 layers, own weights) with their norms and
    activation, in bf16 and FP8, and the bf16 LM head."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.bf16: list[dict[str, torch.Tensor]] = []
        self.fp8: list[dict[str, Linear]] = []
        for _ in range(LAYERS):
            weights = {name: torch.randn(SHAPES[name][1], SHAPES[name][0], dtype=torch.bfloat16, device="cuda")
                       * SHAPES[name][0] ** -0.5 for name in PROJECTIONS}
            self.fp8.append({name: fp8_layer(w) for name, w in weights.items()})
            self.bf16.append(weights)
        self.norm = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
        k, n, _ = SHAPES["lm_head"]
        self.lm_head = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5

    def variants(self, m: int) -> dict[str, Callable[[], object]]:
        h = torch.randn(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn_like(h)
        attn = torch.randn(m, SHAPES["o"][0], dtype=torch.bfloat16, device="cuda")  # attention's output
        # the head's rows: one per sequence (a decode step's every row; a prefill's last tokens)
        eps, head = 1e-5, lambda: F.linear(h[-min(m, 256):], self.lm_head)

        def bf16() -> None:
            for w in self.bf16:
                F.linear(norm.rms_norm(residual, self.norm, eps), w["qkv"])
                out = F.linear(attn, w["o"])
                norm.fused_add_rms_norm(out, residual, self.norm, eps)
                F.linear(activation.silu_and_mul(F.linear(out, w["gate_up"])), w["down"])
            head()

        def fp8() -> None:
            for lin in self.fp8:
                lin["qkv"](QuantizedInput(*norm.rms_norm_fp8(residual, self.norm, eps, None)))
                out = lin["o"](QuantizedInput(*fp8_quant.quantize_fp8(attn, None)))
                gate_up = lin["gate_up"](QuantizedInput(*norm.fused_add_rms_norm_fp8(out, residual, self.norm, eps,
                                                                                     None)))
                lin["down"](QuantizedInput(*fp8_quant.silu_and_mul_fp8(gate_up, None)))
            head()

        def unfused() -> None:
            for lin in self.fp8:
                x = QuantizedInput(*reference.quantize_fp8(norm.rms_norm(residual, self.norm, eps)))
                scaled_mm(x, lin["qkv"])
                out = scaled_mm(QuantizedInput(*reference.quantize_fp8(attn)), lin["o"])
                norm.fused_add_rms_norm(out, residual, self.norm, eps)
                gate_up = scaled_mm(QuantizedInput(*reference.quantize_fp8(out)), lin["gate_up"])
                scaled_mm(QuantizedInput(*reference.quantize_fp8(activation.silu_and_mul(gate_up))),
                          lin["down"])
            head()

        inputs = {name: QuantizedInput(*reference.quantize_fp8(torch.randn(m, SHAPES[name][0], dtype=torch.bfloat16,
                                                                           device="cuda"))) for name in PROJECTIONS}

        def bare(product: Callable[[QuantizedInput, Linear], torch.Tensor]) -> Callable[[], None]:
            def run() -> None:
                for lin in self.fp8:
                    for name in PROJECTIONS:
                        product(inputs[name], lin[name])
                head()
            return run

        found: dict[str, Callable[[], object]] = {"bf16": bf16, "fp8": fp8, "fp8-unfused": unfused,
                                                  "scaled_mm": bare(scaled_mm)}
        if m <= fp8_gemv.MAX_ROWS:
            found["gemv"] = bare(gemv)
        return found


def gemm_rows(sizes: list[int], rate: float) -> list[dict[str, object]]:
    products = StepProducts()
    peaks = next((p for gpu, p in PEAKS.items() if gpu in torch.cuda.get_device_name()), None)
    flop_per_token = 2 * sum(SHAPES[n][0] * SHAPES[n][1] for n in PROJECTIONS) * LAYERS
    weight_bytes = {"bf16": 2, "fp8": 1}
    rows: list[dict[str, object]] = []
    for m in sizes:
        for variant, run in products.variants(m).items():
            ms = graph_us([run], reps=10) / 1e3
            dtype = "bf16" if variant == "bf16" else "fp8"
            tflops = flop_per_token * m / (ms * 1e-3) / 1e12  # the 32 layers' products (head excluded)
            streamed = flop_per_token / 2 * weight_bytes[dtype] + 2 * SHAPES["lm_head"][0] * SHAPES["lm_head"][1]
            rows.append({"m": m, "variant": variant, "step_ms": ms, "tflops": tflops,
                         "of_peak": tflops / peaks[dtype] if peaks else None,
                         "floor_ms": streamed / rate * 1e3, "weights_of_copy_rate": streamed / (ms * 1e-3) / rate})
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def engine_run(name: str) -> dict[str, object]:
    """One engine configuration, in this (child) process."""
    import random

    import bench_engine_gpu

    from kvpilot.bench.throughput import measure
    from kvpilot.bench.workload import RandomSpec, random_requests
    from kvpilot.runtime import LLM

    bench_engine_gpu.NEW_TOKENS = NEW_TOKENS
    started = time.perf_counter()
    llm = LLM("llama-3-8b", load_format="dummy", device="cuda", max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.9, **ENGINES[name])
    result: dict[str, object] = {"engine": name, "engine_start_s": time.perf_counter() - started,
                                 "num_kv_blocks": llm.engine.runner.num_blocks,
                                 "weight_bytes": llm.engine.runner.model.streamed_weight_bytes()}
    spans = bench_engine_gpu.timed_forward(llm.engine.runner)
    clock = bench_engine_gpu.ClockLog()
    rng = random.Random(0)
    for batch in (1, 256):
        prompts = [[rng.randrange(1000, 100000) for _ in range(PROMPT_LEN)] for _ in range(batch)]
        row = bench_engine_gpu.decode_steps(llm, prompts, spans, f"{name}-{batch}", clock)
        result[f"decode_b{batch}"] = row
    clock.close()
    offline = measure(llm, random_requests(RandomSpec(1000, 256, 256)))
    result["offline_total_tok_s"] = offline["total_tokens_per_s"]
    result["offline_output_tok_s"] = offline["output_tokens_per_s"]
    result["offline_elapsed_s"] = offline["elapsed_s"]
    llm.shutdown()
    return result


def engines(names: list[str], out: Path) -> list[dict[str, object]]:
    from kvpilot.runtime.args import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    results = []
    for name in names:
        if not set(ENGINES[name]) <= known:
            results.append({"engine": name, "skipped": f"this engine has no {sorted(set(ENGINES[name]) - known)}"})
            continue
        path = out / f"engine-{name}.json"
        try:
            done = subprocess.run([sys.executable, __file__, "--engine-child", name, "--out", str(path)],
                                  env=os.environ, timeout=420)
            failed: object = done.returncode
        except subprocess.TimeoutExpired:
            failed = "timed out after 420 s"
        results.append(json.loads(path.read_text()) if failed == 0 and path.exists()
                       else {"engine": name, "failed": failed})
        print(json.dumps(results[-1]), flush=True)
    return results


def summary(head: dict[str, object], checks: list[dict[str, object]], gemms: list[dict[str, object]],
            runs: list[dict[str, object]]) -> str:
    lines = [f"summary  {head['gpu']}  copy {head['copy_TBps']:.2f} TB/s  torch {head['torch']}"]
    bad = [c for c in checks if not c["ok"]]
    lines.append(f"correctness: {len(checks) - len(bad)}/{len(checks)} ok" + "".join(f"\n  FAIL {c}" for c in bad))
    if gemms:
        lines.append("step products (32 layers + head), ms | TFLOP/s share of peak:")
        by_m: dict[int, dict[str, dict[str, object]]] = {}
        for r in gemms:
            by_m.setdefault(int(r["m"]), {})[str(r["variant"])] = r  # type: ignore[call-overload]
        names = ["bf16", "fp8", "fp8-unfused", "scaled_mm", "gemv"]
        lines.append("  M      " + "".join(f"{n:>18}" for n in names) + "   fp8/bf16")
        for m, row in sorted(by_m.items()):
            cells = "".join(f"{row[n]['step_ms']:8.2f} {row[n]['of_peak'] or 0:8.0%} " if n in row else " " * 18
                            for n in names)
            lines.append(f"  {m:<6} {cells} {row['fp8']['step_ms'] / row['bf16']['step_ms']:8.2f}")  # type: ignore[operator]
    for r in runs:
        if "decode_b1" not in r:
            lines.append(f"engine {r['engine']}: {r.get('skipped') or 'failed: ' + str(r.get('failed'))}")
            continue
        b1, b256 = r["decode_b1"], r["decode_b256"]
        lines.append(f"engine {r['engine']:7} one stream {b1['decode_step_ms']:.2f} ms/token, "  # type: ignore[index]
                     f"b256 step {b256['decode_step_ms']:.2f} ms (forward {b256['forward_ms']:.2f}), "  # type: ignore[index]
                     f"offline 1000x256/256 {r['offline_total_tok_s']:.0f} tok/s, KV blocks {r['num_kv_blocks']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results")
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--skip-engines", action="store_true")
    parser.add_argument("--skip-gemms", action="store_true")
    parser.add_argument("--decode-sizes", type=int, nargs="+", default=DECODE_SIZES)
    parser.add_argument("--prefill-sizes", type=int, nargs="+", default=PREFILL_SIZES)
    parser.add_argument("--engine-child", choices=list(ENGINES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:  # --out is then the child's JSON file
        args.out.write_text(json.dumps(engine_run(args.engine_child), indent=1))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    # the engines first, each in a process of its own, while this one holds no device memory
    runs = [] if args.skip_engines else engines(args.engines, args.out)
    rate = copy_rate()
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_TBps": rate / 1e12,
            "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(head), flush=True)
    checks = correctness()
    for row in checks:
        print(json.dumps(row), flush=True)
    gemms = [] if args.skip_gemms else gemm_rows(args.decode_sizes + args.prefill_sizes, rate)
    (args.out / "bench_fp8.json").write_text(json.dumps({**head, "correctness": checks, "gemms": gemms,
                                                         "engines": runs}, indent=1))
    print(summary(head, checks, gemms, runs))


if __name__ == "__main__":
    main()
