"""The matrix products of a decode step, timed as the engine runs them: for each of the Llama-3-8B
projections (qkv, o, gate/up, down; and the LM head once), 32 launches, each on its own layer's
weight (so no weight stays in L2 for the next), recorded into one CUDA graph and replayed, at the
batch sizes given. Per shape: microseconds a launch, TFLOP/s, the weights' read rate, and the
step's total (32 layers of the four plus the head).

Variants (each checked against the engine's own `F.linear` on the same inputs; "bitwise" says
whether the output is identical, else the largest difference):

  linear      F.linear(x, W), W stored (out, in): what the engine runs (torch's default BLAS)
  cublaslt    the same call with torch.backends.cuda.preferred_blas_library("cublaslt")
  kn          x @ W_t with W_t stored (in, out) contiguous: the other operand layout

At batch 256 the step's products are compute-bound (RESULTS: 6.08 ms for 3.8 TFLOP at context
~1,024); this says whether another library path or layout reaches more of the chip's rate.

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_gemm_decode.py [--batches 1 256] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
SHAPES = {  # name: (in_features, out_features, launches a step)
    "qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, LAYERS),
    "o": (HEADS * HEAD_DIM, HIDDEN, LAYERS),
    "gate_up": (HIDDEN, 2 * INTERMEDIATE, LAYERS),
    "down": (INTERMEDIATE, HIDDEN, LAYERS),
    "lm_head": (HIDDEN, VOCAB, 1),
}
VARIANTS = ("linear", "cublaslt", "kn")


def graph_us(launches: list[Callable[[], torch.Tensor]], reps: int = 20) -> float:
    """The launches captured into one graph; median microseconds a launch over `reps` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # cuBLAS picks its kernels and workspace outside the capture
        for launch in launches:
            launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / len(launches))
    return sorted(times)[len(times) // 2]


def measure(batch: int, name: str, variant: str) -> dict[str, object]:
    k, n, count = SHAPES[name]
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5 for _ in range(count)]
    x = torch.randn(batch, k, dtype=torch.bfloat16, device="cuda")
    reference = F.linear(x, weights[0])
    if variant == "kn":
        transposed = [w.t().contiguous() for w in weights]
        del weights
        launches = [lambda w=w: x @ w for w in transposed]
    else:
        launches = [lambda w=w: F.linear(x, w) for w in weights]
    previous = torch.backends.cuda.preferred_blas_library()
    if variant == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        out = launches[0]()
        us = graph_us(launches)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    flop = 2 * batch * k * n
    return {"batch": batch, "shape": name, "variant": variant, "us": us, "launches": count,
            "tflops": flop / (us * 1e-6) / 1e12, "weight_tb_s": 2 * k * n / (us * 1e-6) / 1e12,
            "bitwise": bool(torch.equal(out, reference)),
            "max_abs_diff": float((out.float() - reference.float()).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm_decode.py times CUDA kernels: no GPU here")
    rows = []
    for batch in args.batches:
        for variant in args.variants:
            step_us = 0.0
            for name in SHAPES:
                row = measure(batch, name, variant)
                step_us += row["us"] * row["launches"]  # type: ignore[operator]
                rows.append(row)
                print(json.dumps(row), flush=True)
            rows.append({"batch": batch, "variant": variant, "step_ms": step_us / 1e3})
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
