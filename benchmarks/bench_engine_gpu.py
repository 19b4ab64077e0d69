"""Whole-engine GPU throughput: decode of a Llama-3-8B-shaped model (dummy bf16 weights) at several
batch sizes, the median decode step against its bandwidth floor (weights + the KV read once per step,
at the copy rate measured in the same run). Correctness on CUDA is tests/runtime/test_gpu_engine.py.

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_engine_gpu.py [--batches 1 32 128 256] [--out FILE]
                 [--enforce-eager]  (no CUDA graphs for decode steps)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from kvpilot.runtime import LLM, SamplingParams

PROMPT_LEN, NEW_TOKENS = 512, 128


def copy_rate() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy: the traffic ceiling, so a
    step's floor is the bytes it must read over this rate."""
    import triton

    src = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 4 * (1 << 29) / (ms * 1e-3)


def throughput(batches: list[int], rate: float, enforce_eager: bool = False) -> list[dict[str, float]]:
    started = time.perf_counter()
    llm = LLM("llama-3-8b", load_format="dummy", device="cuda", max_model_len=PROMPT_LEN + NEW_TOKENS + 16,
              max_num_seqs=max(batches), max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
              enforce_eager=enforce_eager)
    print(json.dumps({"engine_start_s": time.perf_counter() - started, "enforce_eager": enforce_eager}), flush=True)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(PROMPT_LEN)]}], SamplingParams(max_tokens=4))
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    kv_per_token = llm.engine.runner.bytes_per_block // llm.engine.config.cache.block_size
    rows = []
    for batch in batches:
        prompts = [{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(PROMPT_LEN)]} for _ in range(batch)]
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(f"b{batch}-{i}", p["prompt_token_ids"], params)
        decode_times = []
        torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            stats = engine.last_step
            if stats is not None and stats.num_prompt_tokens == 0 and stats.num_generation_tokens == batch:
                decode_times.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - start
        decode_times.sort()
        step = decode_times[len(decode_times) // 2]
        # one decode step reads every weight and, on average, half the generated context's KV once
        floor = (weight_bytes + batch * (PROMPT_LEN + NEW_TOKENS // 2) * kv_per_token) / rate
        rows.append({"batch": batch, "output_tok_s": batch * NEW_TOKENS / elapsed, "decode_step_ms": step * 1e3,
                     "floor_ms": floor * 1e3, "of_floor": floor / step, "decode_tok_s": batch / step})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    args = parser.parse_args()
    rate = copy_rate()
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_TBps": rate / 1e12,
            "cuda_graphs": not args.enforce_eager}
    print(json.dumps(head), flush=True)
    rows = throughput(args.batches, rate, args.enforce_eager)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({**head, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
