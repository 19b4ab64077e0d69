"""Where a decode step's time goes on the GPU: the kernels of steady-state decode steps (every
sequence of the batch decoding), grouped by what they do, against the steps' time. "gaps" is the
time between the first kernel and the last that no kernel fills (launch gaps inside a graph, the
device waiting for the host); "edges" is the rest of the profiled window's wall time, chiefly the
host preparing the first step after the window's start (the device idles there by construction),
so it shrinks as --steps grows and is not part of a steady step. "step_unprofiled" is the median
time between two `step()` returns over as many steps just before, without the profiler.

Llama-3-8B shape, dummy bf16 weights, the engine's defaults (CUDA graphs, async scheduling unless
--no-async-scheduling); torch's profiler records the kernels a graph replays.

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/profile_step_gpu.py [--batches 1 256] [--prompt-len 512]
                 [--steps 20] [--no-async-scheduling] [--enforce-eager] [--top 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.engine.engine import LLMEngine

# first match wins; kernel names as the profiler reports them (Triton: the jitted function's name)
GROUPS = (
    ("attention", r"^_(decode|decode_tma|prefill|reduce)_kernel|flash|fmha"),
    ("matmul", r"gemm|gemv|nvjet|xmma|cutlass|sm90_|cublas|splitK"),
    ("norm", r"rms_norm"),
    ("rotary", r"rotary"),
    ("kv write", r"write_kv"),
    ("sampling", r"argmax|ArgMax|sort|topk|softmax|multinomial|exponential|distribution"),
    ("elementwise", r"elementwise|vectorized|silu|unrolled|CatArray|copy_kernel"),
)
COPIES = ("gpu_memcpy", "gpu_memset")


def group_of(name: str) -> str:
    return next((group for group, pattern in GROUPS if re.search(pattern, name)), "other")


def full_decode(engine: LLMEngine, batch: int) -> bool:
    stats = engine.last_step
    return (stats is not None and stats.num_prompt_tokens == 0 and stats.num_batched_tokens == batch
            and stats.num_generation_tokens == batch)


def profile_batch(llm: LLM, batch: int, prompt_len: int, steps: int, top: int) -> dict[str, object]:
    engine, rng = llm.engine, random.Random(batch)
    vocab = min(100000, llm.engine.runner.model.cfg.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=3 * steps + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profile-{batch}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params)
    while not full_decode(engine, batch):
        engine.step()
    returns = [time.perf_counter()]
    for _ in range(steps):  # also keeps the profiler's own start-up out of the steps it times
        engine.step()
        returns.append(time.perf_counter())
    unprofiled_ms = statistics.median(b - a for a, b in itertools.pairwise(returns)) * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1e3
    for i in range(batch):
        engine.abort_request(f"profile-{batch}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    device = [e for e in events if e.get("cat") in ("kernel", *COPIES) and "dur" in e]
    by_group: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in device:
        group = "copies" if e["cat"] in COPIES else group_of(e["name"])
        by_group[group] += e["dur"] / 1e3
        by_kernel[e["name"]][0] += e["dur"] / 1e3
        by_kernel[e["name"]][1] += 1
    busy = sum(by_group.values())
    span = (max(e["ts"] + e["dur"] for e in device) - min(e["ts"] for e in device)) / 1e3 if device else 0.0
    per_step = {g: ms / steps for g, ms in sorted(by_group.items(), key=lambda kv: -kv[1])}
    kernels = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "batch": batch, "prompt_len": prompt_len, "steps": steps, "step_ms": wall_ms / steps,
        "step_unprofiled_ms": unprofiled_ms, "device_busy_ms": busy / steps,
        "gaps_ms": max(0.0, span - busy) / steps, "edges_ms": max(0.0, wall_ms - span) / steps,
        "kernel_span_ms": span / steps, "kernels_per_step": len(device) / steps, "groups_ms": per_step,
        "top_kernels": [{"name": name[:90], "group": group_of(name), "ms_per_step": ms / steps,
                         "launches_per_step": n / steps} for name, (ms, n) in kernels],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="decode steps profiled per batch size")
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per batch size")
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON")
    args = parser.parse_args()
    llm = LLM("llama-3-8b", load_format="dummy", device="cuda",
              max_model_len=args.prompt_len + 4 * args.steps + 80, max_num_seqs=max(args.batches),
              max_num_batched_tokens=8192, gpu_memory_utilization=0.9, enforce_eager=args.enforce_eager,
              async_scheduling=not args.no_async_scheduling)
    rows = []
    for batch in args.batches:
        row = profile_batch(llm, batch, args.prompt_len, args.steps, args.top)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "cuda_graphs": not args.enforce_eager,
                                        "async_scheduling": not args.no_async_scheduling, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
