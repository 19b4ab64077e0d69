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
  triton      a persistent Triton kernel reading both operands by TMA (one program per SM walking
              the output tiles, the two row tiles of a weight tile back to back so it is read
              once), tile shape autotuned per shape over a few configs
  triton_k2   the same with the reduction split in two (float32 partials, then a sum kernel):
              twice the work items for the shapes whose tiles do not fill the SMs

At batch 256 the step's products are compute-bound (benchmarks/RESULTS.md, "Where the batch-256
step goes"); this says whether another library path or layout reaches more of the chip's rate.

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_gemm_decode.py [--batches 1 256] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
SHAPES = {  # name: (in_features, out_features, launches a step)
    "qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, LAYERS),
    "o": (HEADS * HEAD_DIM, HIDDEN, LAYERS),
    "gate_up": (HIDDEN, 2 * INTERMEDIATE, LAYERS),
    "down": (INTERMEDIATE, HIDDEN, LAYERS),
    "lm_head": (HIDDEN, VOCAB, 1),
}
VARIANTS = ("linear", "cublaslt", "kn", "triton", "triton_k2")


def _set_blocks(nargs: dict[str, object]) -> None:
    """The autotuner's pre-hook: each descriptor's box is the tile shape of the config tried."""
    bm, bn, bk = nargs["BM"], nargs["BN"], nargs["BK"]
    nargs["x_desc"].block_shape = [bm, bk]  # type: ignore[attr-defined]
    nargs["w_desc"].block_shape = [bn, bk]  # type: ignore[attr-defined]
    nargs["y_desc"].block_shape = [bm, bn]  # type: ignore[attr-defined]


TILES = [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 128, 64, 6, 4), (64, 256, 64, 4, 8),
         (128, 64, 64, 6, 4), (128, 128, 128, 3, 8), (64, 64, 128, 6, 4), (128, 256, 64, 4, 8)]


@triton.autotune(configs=[triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_stages=stages, num_warps=warps,
                                        pre_hook=_set_blocks) for bm, bn, bk, stages, warps in TILES],
                 key=["M", "N", "K", "SPLIT"])
@triton.jit
def _linear_kernel(x_desc, w_desc, y_desc, M, N, K, SPLIT: tl.constexpr, NUM_SMS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    tiles_m = tl.cdiv(M, BM)
    tiles = tiles_m * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK) // SPLIT
    for unit in range(tl.program_id(0), tiles * SPLIT, NUM_SMS):
        part, tile = unit // tiles, unit % tiles
        pid_m, pid_n = tile % tiles_m, tile // tiles_m  # row tiles of one weight tile run together
        acc = tl.zeros((BM, BN), tl.float32)
        for kk in range(k_tiles):
            k = (part * k_tiles + kk) * BK
            acc = tl.dot(x_desc.load([pid_m * BM, k]), w_desc.load([pid_n * BN, k]).T, acc)
        if SPLIT == 1:
            y_desc.store([pid_m * BM, pid_n * BN], acc.to(y_desc.dtype))
        else:
            y_desc.store([part * M + pid_m * BM, pid_n * BN], acc)


@triton.jit
def _sum_parts_kernel(parts, y, MN, SPLIT: tl.constexpr, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    mask = i < MN
    acc = tl.load(parts + i, mask=mask)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(parts + s * MN + i, mask=mask)
    tl.store(y + i, acc.to(y.dtype.element_ty), mask=mask)


def triton_linear(x: torch.Tensor, w: torch.Tensor, split: int) -> Callable[[], torch.Tensor]:
    """A launch of y = x W^T by `_linear_kernel` (split-K in `split` parts), its buffers made once."""
    (m, k), n = x.shape, w.shape[0]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split * m, n, dtype=torch.float32, device=x.device)
    descs = [TensorDescriptor.from_tensor(t, [64, 64]) for t in (x, w, out)]

    def launch() -> torch.Tensor:
        _linear_kernel[(sms,)](*descs, m, n, k, SPLIT=split, NUM_SMS=sms)
        if split > 1:
            _sum_parts_kernel[(triton.cdiv(m * n, 4096),)](out, y, m * n, SPLIT=split, B=4096)
        return y
    return launch


def captured(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn's launches in one CUDA graph, run once on a side stream first (cuBLAS picks its kernels
    and workspace, Triton compiles, outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(launches: list[Callable[[], torch.Tensor]], reps: int = 20) -> float:
    """The launches captured into one graph; median microseconds a launch over `reps` replays."""
    def run_all() -> None:
        for launch in launches:
            launch()
    graph = captured(run_all)
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
    elif variant.startswith("triton"):
        launches = [triton_linear(x, w, 2 if variant == "triton_k2" else 1) for w in weights]
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
