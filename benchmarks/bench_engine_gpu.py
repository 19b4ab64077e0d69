"""Whole-engine GPU check and throughput: the embedded SmolLM2 answers correctly on CUDA with the
Triton kernels, then decode throughput of a Llama-3-8B-shaped model (dummy bf16 weights) at
several batch sizes, with the step time against the bandwidth floor of ANCHORS.md.

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_engine_gpu.py [--batches 1 32 128 256]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from kvpilot.runtime import LLM, SamplingParams

PROMPT_LEN, NEW_TOKENS = 512, 128


def smoke() -> dict[str, object]:
    llm = LLM(device="cuda", max_model_len=2048, gpu_memory_utilization=0.3)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    kernels = llm.engine.runner.ops.__name__
    del llm
    torch.cuda.empty_cache()
    return {"answer": out.text, "kernels": kernels}


def throughput(batches: list[int]) -> list[dict[str, float]]:
    llm = LLM("llama-3-8b", load_format="dummy", device="cuda", max_model_len=PROMPT_LEN + NEW_TOKENS + 16,
              max_num_seqs=max(batches), max_num_batched_tokens=8192, gpu_memory_utilization=0.9)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(PROMPT_LEN)]}], SamplingParams(max_tokens=4))
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
        floor = (15.0e9 + batch * (PROMPT_LEN + NEW_TOKENS // 2) * 131072) / 4.3e12
        rows.append({"batch": batch, "output_tok_s": batch * NEW_TOKENS / elapsed, "decode_step_ms": step * 1e3,
                     "floor_ms": floor * 1e3})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    args = parser.parse_args()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}))
    print(json.dumps(smoke()))
    for row in throughput(args.batches):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
