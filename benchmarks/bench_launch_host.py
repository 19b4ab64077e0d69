"""Host time of kvpilot's own code, with the device work stubbed out; no GPU needed.

Two parts (`--parts`):

* `launch`: the kernel launchers per call, with the Triton kernels stubbed out: what each op costs
  the host before Triton's launcher takes over (eager steps pay it per op, layer and step; graph
  replays do not). CPU tensors at the decode-benchmark shapes.
* `engine`: the whole engine's decode step as `benchmarks/bench_engine_gpu.py` runs it (batches of
  512-token prompts, 128 new tokens each, greedy, EOS ignored), with only the model's forward pass
  replaced: the real scheduler, block manager, step inputs, their tensors staged into the decode
  CUDA graphs' static buffers (`DecodeGraphs.stage`, on CPU tensors), the sampling rows picked out
  of a logits buffer of zeros (the model's head is one launch on a GPU), sampling and
  postprocessing. On a GPU with graphs this is the host's share of a step: what the graph replay
  does not hide. One torch thread (the host's torch work stands for launches, not for CPU math).
  The median decode step per batch size, best of `--repeats`. `--profile N` prints cProfile's top
  N functions over one more run of the largest batch.

Usage: PYTHONSAFEPATH=1 python benchmarks/bench_launch_host.py [--parts launch engine] [--batches 1 128 256]
           [--repeats 3] [--profile 25] [--output FILE]  (with kvpilot importable)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvpilot.kernels import activation, cache, norm, rotary
from kvpilot.kernels.paged_attention import launcher, pointer_decode, prefill, tma_decode
from kvpilot.kernels.reference import kv_cache_empty
from kvpilot.kernels.step_plan import StepPlan
from kvpilot.kernels.triton_ops import TritonOps
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.executor.batch import to_tensors
from kvpilot.runtime.executor.cuda_graphs import DecodeGraphs
from kvpilot.runtime.executor.inputs import StepInputs
from kvpilot.runtime.executor.model_runner import ModelRunner

PROMPT_LEN, NEW_TOKENS = 512, 128  # bench_engine_gpu.py's


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def per_call_us(fn: Callable[[], object], n: int = 2000, repeats: int = 7) -> float:
    """Best of `repeats` runs of n calls (the host's noise only ever adds time)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / n * 1e6


def launch_part() -> dict[str, float]:
    """Per-call host time of each launcher, in µs."""
    for module, name in ((pointer_decode, "_decode_kernel"), (tma_decode, "_decode_tma_kernel"),
                         (prefill, "_prefill_kernel"), (pointer_decode, "_reduce_kernel"),
                         (cache, "_write_kv_cache_kernel"), (norm, "_rms_norm_kernel"), (rotary, "_rotary_kernel"),
                         (activation, "_silu_and_mul_kernel")):
        setattr(module, name, _NoLaunch())
    b, ctx, heads, kv_heads, d, block_size = 64, 2048, 32, 8, 128, 16
    num_blocks = b * ctx // block_size
    k_cache, v_cache = (kv_cache_empty(num_blocks, block_size, kv_heads, d, head_major=True,
                                       dtype=torch.float32, device=torch.device("cpu")) for _ in range(2))
    tables = torch.arange(num_blocks, dtype=torch.int32).view(b, -1)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    q, k, v = torch.randn(b, heads, d), torch.randn(b, kv_heads, d), torch.randn(b, kv_heads, d)
    slots, positions = torch.arange(b), torch.arange(b)
    x, res, w = torch.randn(b, 4096), torch.randn(b, 4096), torch.ones(4096)
    gate_up = torch.randn(b, 2 * 14336)
    rope = torch.randn(ctx, d)
    plan = StepPlan(positions, slots, tables, seq_lens, qsl, 1, rope, block_size)
    # one stream at context 1,024: the split-KV path (a decode launch and a reduce)
    tables1, seq_lens1, qsl1 = tables[:1, :1024 // block_size], seq_lens[:1].clone().fill_(1024), qsl[:2]
    triton_ops = TritonOps()
    ops = {
        "paged_attention (decode batch)": lambda: launcher.paged_attention(q, k_cache, v_cache, tables, seq_lens,
                                                                            qsl, 0.1, 1),
        "  the same through TritonOps": lambda: triton_ops.paged_attention(q, k_cache, v_cache, plan, 0.1),
        "paged_attention (one stream)": lambda: launcher.paged_attention(q[:1], k_cache, v_cache, tables1, seq_lens1,
                                                                          qsl1, 0.1, 1),
        "write_kv_cache": lambda: cache.write_kv_cache(k, v, k_cache, v_cache, slots),
        "rotary_embedding": lambda: rotary.rotary_embedding(positions, q, k, rope),
        "rotary_and_write_kv": lambda: rotary.rotary_and_write_kv(positions, q, k, rope, v, k_cache, v_cache, slots),
        "silu_and_mul": lambda: activation.silu_and_mul(gate_up),
        "fused_add_rms_norm": lambda: norm.fused_add_rms_norm(x, res, w, 1e-5),
    }
    results = {}
    for name, fn in ops.items():
        results[name.strip()] = per_call_us(fn)
        print(f"{name:32s} {results[name.strip()]:6.1f} µs", flush=True)
    return results


class HostOnlyForward:
    """Stands in for `ModelRunner._run` (the forward pass): the host work of the path a GPU step
    takes, without the model. A decode step is staged into decode-graph static buffers as a graph
    replay would be (eagerly run steps build their tensors as the eager path does); the sampling
    rows' logits are rows of a buffer of zeros (the tokens sampled are all 0)."""

    def __init__(self, runner: ModelRunner) -> None:
        config = runner.config
        self.runner = runner
        max_len = config.model.max_model_len
        self.graphs = DecodeGraphs(lambda *_: torch.empty(0), config.scheduler.max_num_seqs,
                                   -(-max_len // runner.block_size), runner.device)
        rows = max(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
        self.logits = torch.zeros(rows, runner.model_config.vocab_size)

    def __call__(self, inputs: StepInputs) -> tuple[torch.Tensor | None, None]:
        if not (inputs.is_decode_only and self.graphs.stage(inputs) is not None):
            to_tensors(inputs, self.runner.device)
        if not inputs.logits_rows:
            return None, None
        return self.logits[torch.tensor(inputs.logits_rows, dtype=torch.long)], None


def engine_llm(max_num_seqs: int, prompt_len: int, new_tokens: int) -> LLM:
    """bench_engine_gpu.py's engine on the CPU: a tiny Llama (dummy weights) in its place."""
    llm = LLM("tiny-llama", load_format="dummy", device="cpu", max_model_len=prompt_len + new_tokens + 16,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, swap_space=0.01)
    runner = llm.engine.runner
    runner._run = HostOnlyForward(runner)  # type: ignore[method-assign]
    return llm


def decode_step_ms(llm: LLM, prompts: list[list[int]], new_tokens: int, tag: str,
                   profiler: cProfile.Profile | None = None) -> float:
    """Run the prompts to `new_tokens` tokens each; the median time of the steps that decode the
    whole batch (as bench_engine_gpu.py counts them)."""
    engine, batch = llm.engine, len(prompts)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    steps = []
    while engine.has_unfinished_requests():
        if profiler is not None:
            profiler.enable()
        t = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t
        if profiler is not None:
            profiler.disable()
        stats = engine.last_step
        if stats is not None and stats.num_prompt_tokens == 0 and stats.num_generation_tokens == batch:
            steps.append(elapsed)
    if not steps:
        raise RuntimeError(f"no step decoded the whole batch of {batch}")
    return statistics.median(steps) * 1e3


def engine_part(batches: list[int], repeats: int, prompt_len: int, new_tokens: int,
                profile_top: int) -> list[dict[str, float | str]]:
    torch.set_num_threads(1)
    llm = engine_llm(max(batches), prompt_len, new_tokens)
    vocab = llm.engine.runner.model_config.vocab_size
    prompt = [i % (vocab - 3) + 3 for i in range(prompt_len)]  # past BOS/EOS, identical: no cache hits matter
    decode_step_ms(llm, [prompt], 4, "warm-up")
    rows = []
    for batch in batches:
        runs = [decode_step_ms(llm, [list(prompt) for _ in range(batch)], new_tokens, f"b{batch}-{r}")
                for r in range(repeats)]
        rows.append({"batch": batch, "decode_step_ms": min(runs), "runs_ms": runs})
        print(f"engine decode step, batch {batch:4d}: {min(runs):7.3f} ms "
              f"(runs: {', '.join(f'{r:.3f}' for r in runs)})", flush=True)
    if profile_top:
        batch = max(batches)
        profiler = cProfile.Profile()
        decode_step_ms(llm, [list(prompt) for _ in range(batch)], new_tokens, "profile", profiler)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(profile_top)
        stats.sort_stats("cumulative").print_stats(profile_top)
        print(f"cProfile over every step of a batch-{batch} run:\n{text.getvalue()}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=("launch", "engine"), default=["launch", "engine"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 128, 256], help="engine: decode batch sizes")
    parser.add_argument("--repeats", type=int, default=3, help="engine: runs per batch size (the best is kept)")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="engine: tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="engine: tokens generated per prompt")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="engine: print cProfile's top N functions over one run of the largest batch")
    parser.add_argument("--output", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    for flag in ("repeats", "prompt_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the first token comes from the prefill step)")
    if any(b < 1 for b in args.batches):
        parser.error("--batches must be positive")
    if args.profile < 0:
        parser.error("--profile must be >= 0")
    result: dict[str, object] = {"host": platform.processor() or platform.machine(), "torch": torch.__version__,
                                 "threads": torch.get_num_threads()}
    if "launch" in args.parts:
        result["launch_us"] = launch_part()
    if "engine" in args.parts:
        result["engine"] = engine_part(args.batches, args.repeats, args.prompt_len, args.new_tokens, args.profile)
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
