"""CPU throughput on the embedded SmolLM2: kvpilot's continuous batching vs HF transformers.

16 prompts of 8-100 tokens, 64 new tokens each (greedy, EOS ignored, so every run produces the
same 1,024 tokens); HF one prompt at a time and HF on one left-padded batch, same run, same
weights. Usage: PYTHONSAFEPATH=1 .venv/bin/python benchmarks/bench_cpu.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.model_source import resolve_model

NUM_PROMPTS, NEW_TOKENS = 16, 64


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [8 + round(i * (100 - 8) / (NUM_PROMPTS - 1)) for i in range(NUM_PROMPTS)]
    rng.shuffle(lengths)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def bench_kvpilot(prompts: list[list[int]]) -> float:
    llm = LLM(max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == NUM_PROMPTS * NEW_TOKENS
    return NUM_PROMPTS * NEW_TOKENS / elapsed


def bench_hf(prompts: list[list[int]], batched: bool) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=torch.float32).eval()
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    start = time.perf_counter()
    with torch.no_grad():
        if batched:
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            model.generate(ids, attention_mask=mask, **kwargs)
        else:
            for p in prompts:
                model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs)
    return NUM_PROMPTS * NEW_TOKENS / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-hf-sequential", action="store_true")
    args = parser.parse_args()
    prompts = make_prompts(49152)
    rows = []
    for _ in range(args.repeats):
        rows.append(("kvpilot (continuous batching)", bench_kvpilot(prompts)))
        rows.append(("HF generate, left-padded batch of 16", bench_hf(prompts, batched=True)))
        if not args.skip_hf_sequential:
            rows.append(("HF generate, one prompt at a time", bench_hf(prompts, batched=False)))
    print(f"host: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for name, tps in rows:
        print(f"| {name} | {tps:.1f} |")


if __name__ == "__main__":
    main()
