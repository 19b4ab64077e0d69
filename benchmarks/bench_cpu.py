"""CPU throughput on the embedded SmolLM2: kvpilot's continuous batching vs HF transformers.

16 prompts of 8-100 tokens, 64 new tokens each (greedy, EOS ignored, so every run produces the
same 1,024 tokens); HF one prompt at a time and HF on one left-padded batch, same run, same
weights; kvpilot and HF's padded batch alternate --repeats times and medians are reported.
With --steps, one more kvpilot run is stepped by hand and the time of its first step (the prefill
of all 16 prompts) and the median of its decode steps are printed. --skip-hf times kvpilot alone
(a before/after check of two trees, where HF's runs would only add time).
Usage: PYTHONSAFEPATH=1 .venv/bin/python benchmarks/bench_cpu.py [--repeats 3] [--skip-hf-sequential | --skip-hf] [--steps]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
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


class Kvpilot:
    def __init__(self) -> None:
        self.llm = LLM(max_model_len=1024)
        self.llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))  # warm-up

    def run(self, prompts: list[list[int]]) -> float:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outs) == NUM_PROMPTS * NEW_TOKENS
        return NUM_PROMPTS * NEW_TOKENS / elapsed

    def step_times(self, prompts: list[list[int]]) -> list[float]:
        """Seconds per engine step of one run: the prefill step first, then the decode steps."""
        engine = self.llm.engine
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"steps-{i}", p, params)
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times


class HF:
    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=torch.float32).eval()
        self.model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=0)

    def run(self, prompts: list[list[int]], batched: bool) -> float:
        kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        with torch.no_grad():
            if batched:
                width = max(map(len, prompts))
                ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
                self.model.generate(ids, attention_mask=mask, **kwargs)
            else:
                for p in prompts:
                    self.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs)
        return NUM_PROMPTS * NEW_TOKENS / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3, help="alternating kvpilot / HF-padded runs")
    parser.add_argument("--skip-hf-sequential", action="store_true")
    parser.add_argument("--skip-hf", action="store_true", help="kvpilot's runs only")
    parser.add_argument("--steps", action="store_true", help="also time kvpilot's engine steps")
    args = parser.parse_args()
    prompts = make_prompts(49152)
    kv, hf = Kvpilot(), None if args.skip_hf else HF()
    samples: dict[str, list[float]] = {"kvpilot": [], "padded": [], "sequential": []}
    for _ in range(args.repeats):  # alternate, so a slow spell of a shared machine hits both
        samples["kvpilot"].append(kv.run(prompts))
        if hf is not None:
            samples["padded"].append(hf.run(prompts, batched=True))
    if hf is not None and not args.skip_hf_sequential:
        samples["sequential"].append(hf.run(prompts, batched=False))
    # THP_MEM_ALLOC_ENABLE (2 MiB pages, which `kvpilot` sets for itself) is process-wide and read
    # before torch's first allocation, so both sides run under whatever the environment says
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    print(f"host: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, THP_MEM_ALLOC_ENABLE={thp}, {args.repeats} runs, "
          f"median (all runs) in output tokens/s")
    names = {"kvpilot": "kvpilot (continuous batching)", "padded": "HF generate, left-padded batch of 16",
             "sequential": "HF generate, one prompt at a time"}
    for key, runs in samples.items():
        if runs:
            shown = ", ".join(f"{r:.1f}" for r in runs)
            print(f"| {names[key]} | {statistics.median(runs):.1f} | {shown} |")
    if samples["padded"]:
        ratios = [a / b for a, b in zip(samples["kvpilot"], samples["padded"], strict=True)]
        print(f"kvpilot / HF padded, per alternating pair: {', '.join(f'{r:.2f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.2f}; of medians "
              f"{statistics.median(samples['kvpilot']) / statistics.median(samples['padded']):.2f}; "
              f"of bests {max(samples['kvpilot']) / max(samples['padded']):.2f}")
    if args.steps:
        times = kv.step_times(prompts)
        print(f"kvpilot steps: prefill of {sum(map(len, prompts))} prompt tokens {times[0] * 1e3:.0f} ms, "
              f"decode step median {statistics.median(times[1:]) * 1e3:.1f} ms ({len(times) - 1} steps)")


if __name__ == "__main__":
    main()
