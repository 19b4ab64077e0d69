"""Swap against recompute, per preempted sequence and on a served workload.

Part 1 (always): for each block size and context length, what preempting one sequence costs.
  swap       the engine's own swap space moving the sequence's blocks out to host memory and back
             in (`SwapSpace.swap`, waited for): wall time, and the device time its events report
             (what `kvpilot_swap_seconds_total` counts);
  recompute  prefilling the sequence again, the way the engine does it (`LLM.generate` of the
             context, one output token, the engine's prefill chunks).
  The pinned host<->device copy rate is measured in the same run (one large contiguous copy each
  way); `of_copy_rate` is the fraction of it a swap-out plus swap-in reaches. The crossover is the
  shortest context from which swap costs less than recompute.
Part 2 (--parts served): the swap issue's workload offline on `LLMEngine`: requests
  of --input-len random prompt tokens and --output-len output tokens (ignore_eos) arriving as a
  Poisson stream at --request-rate, over a KV budget of --kv-tokens tokens and --swap-space GiB of
  swap, per block size and preemption mode: served req/s, output tok/s, TTFT and E2E percentiles,
  preemptions, swap traffic.

GPU (the issue's setting): PYTHONSAFEPATH=1 python3 benchmarks/bench_swap.py --output swap.json
    [--parts per-sequence served] [--served-block-sizes 16 8]
CPU smoke run (a tiny model): python benchmarks/bench_swap.py --model tiny-llama --device cpu
    --contexts 32 64 --block-sizes 8 16 --reps 1 --parts per-sequence served --num-prompts 6
    --input-len 24 --output-len 32 --kv-tokens 128 --max-model-len 64 --swap-space 0.01 --copy-mib 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvpilot.bench.percentile import percentile
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.sched.sequence import Request
from kvpilot.runtime.tunables import BLOCK_SIZES

MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="a shipped preset (dummy weights) or a model folder")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8000],
                   help="context lengths (tokens) of the preempted sequence")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--reps", type=int, default=3, help="repetitions per measurement (the median is kept)")
    p.add_argument("--kv-tokens", type=int, default=48 * 1024, help="KV budget in tokens (num_gpu_blocks_override)")
    p.add_argument("--swap-space", type=float, default=16.0, help="GiB of host swap space")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the copy that measures the host link")
    p.add_argument("--parts", nargs="+", choices=["per-sequence", "overlap", "served"],
                   default=["per-sequence", "overlap"],
                   help="what to run: the cost per preempted sequence, the overlap with decode steps, the served workload")
    p.add_argument("--overlap-batch", type=int, default=16, help="decoding sequences during the overlap part")
    p.add_argument("--overlap-context", type=int, default=2048,
                   help="tokens of the sequence swapped out and back in during every decode step")
    p.add_argument("--overlap-steps", type=int, default=20)
    p.add_argument("--served-block-sizes", type=int, nargs="+", default=[16])
    p.add_argument("--num-prompts", type=int, default=240)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--request-rate", type=float, default=12.0, help="requests per second (Poisson; inf: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)
    for flag in ("block_sizes", "served_block_sizes"):
        bad = [b for b in getattr(args, flag) if b not in BLOCK_SIZES]
        if bad:
            p.error(f"--{flag.replace('_', '-')}: {bad[0]} is not one of {', '.join(map(str, BLOCK_SIZES))}")
    if min(args.contexts) <= 0 or max(args.contexts) >= args.max_model_len:
        p.error(f"--contexts: each must be in [1, --max-model-len) = [1, {args.max_model_len})")
    if args.kv_tokens < args.max_model_len:
        p.error(f"--kv-tokens ({args.kv_tokens}) must hold one sequence of --max-model-len ({args.max_model_len})")
    if "served" in args.parts and args.input_len + args.output_len > args.max_model_len:
        p.error("--input-len + --output-len must not exceed --max-model-len")
    for flag in ("reps", "num_prompts", "input_len", "output_len", "copy_mib", "overlap_batch", "overlap_context",
                 "overlap_steps"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.request_rate <= 0 or args.swap_space <= 0:
        p.error("--request-rate and --swap-space must be positive")
    return args


def make_llm(args: argparse.Namespace) -> LLM:
    """One engine for every configuration: a block-size change re-cuts the same KV budget (in
    tokens) and the same swap space, and the preemption mode is read at each preemption."""
    block_size = (args.block_sizes if "per-sequence" in args.parts else args.served_block_sizes)[0]
    return LLM(args.model, load_format="dummy" if not Path(args.model).exists() else "auto", device=args.device,
               dtype=args.dtype, block_size=block_size, num_gpu_blocks_override=args.kv_tokens // block_size,
               swap_space=args.swap_space, max_model_len=args.max_model_len, preemption_mode="swap",
               max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)


def use_block_size(llm: LLM, block_size: int) -> None:
    if llm.engine.config.cache.block_size != block_size:
        llm.engine.update_config({"block_size": block_size})


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_rates(device: torch.device, num_bytes: int, reps: int) -> dict[str, float]:
    """Bytes per second of one contiguous copy host->device and device->host (pinned host memory)."""
    pin = device.type == "cuda"
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    rates = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            synchronize(device)
            times.append(time.perf_counter() - start)
        rates[name] = num_bytes / statistics.median(times[1:])
    return rates


def per_sequence(args: argparse.Namespace, llm: LLM, rates: dict[str, float]) -> list[dict[str, object]]:
    rng = random.Random(args.seed)
    rows: list[dict[str, object]] = []
    for block_size in args.block_sizes:
        use_block_size(llm, block_size)
        runner = llm.engine.runner
        space = runner.swap_space
        assert space is not None
        vocab = runner.model_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [rng.randrange(vocab) for _ in range(min(args.contexts))]}], params)
        for context in args.contexts:
            num_blocks = -(-context // block_size)
            if num_blocks > min(space.num_blocks, runner.num_blocks):
                print(f"skip: {context} tokens need {num_blocks} blocks, more than the cache or the swap space holds",
                      file=sys.stderr)
                continue
            device_ids = rng.sample(range(runner.num_blocks), num_blocks)  # a block table's scatter
            host_ids = list(range(num_blocks))  # the scheduler hands out a run
            walls, device_s = [], []
            space.take_stats()
            for _ in range(args.reps + 1):
                synchronize(runner.device)
                start = time.perf_counter()
                space.swap(list(zip(device_ids, host_ids, strict=True)), [])
                space.swap([], list(zip(host_ids, device_ids, strict=True)))
                space.synchronize()
                synchronize(runner.device)
                walls.append(time.perf_counter() - start)
                stats = space.take_stats()
                device_s.append(stats.seconds_out + stats.seconds_in)
            space.swap([], [])  # mark the step, as the engine does every step
            swap_s, swap_device_s = statistics.median(walls[1:]), statistics.median(device_s[1:])
            moved = num_blocks * runner.bytes_per_block
            ideal = moved / rates["d2h"] + moved / rates["h2d"]
            prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(args.reps + 1)]
            recompute = []
            for prompt in prompts:
                synchronize(runner.device)
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], params)
                synchronize(runner.device)
                recompute.append(time.perf_counter() - start)
            recompute_s = statistics.median(recompute[1:])
            row = {"block_size": block_size, "context": context, "bytes_each_way": moved,
                   "swap_ms": swap_s * 1e3, "swap_device_ms": swap_device_s * 1e3,
                   "swap_GBps": 2 * moved / swap_s / 1e9, "of_copy_rate": ideal / swap_s,
                   "recompute_ms": recompute_s * 1e3,
                   "swap_us_per_token": swap_s / context * 1e6, "recompute_us_per_token": recompute_s / context * 1e6,
                   "swap_wins": swap_s < recompute_s}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def overlap(args: argparse.Namespace, llm: LLM) -> list[dict[str, object]]:
    """Decode steps of --overlap-batch sequences, alone and while every step also swaps a sequence
    of --overlap-context tokens out and back in (through the engine's own per-step call, so the
    forward pass waits only for what it must: the swap-out's gather and the earlier step's
    swap-in). Fully hidden copies leave the step at max(step, copies); serial ones at their sum."""
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(args.seed)
    vocab = runner.model_config.vocab_size
    rows: list[dict[str, object]] = []
    for block_size in args.block_sizes:
        use_block_size(llm, block_size)
        bm = engine.block_manager
        num_blocks = -(-args.overlap_context // block_size)
        holder = Request("overlap-holder", None, [0], SamplingParams(), arrival_time=0.0, seq_ids=engine._seq_ids).seqs[0]
        holder.block_table = bm.allocate(num_blocks)  # blocks no sequence of the batch can take
        pairs = list(zip(holder.block_table, range(num_blocks), strict=True))
        inner = runner.swap_blocks
        prompt_len = min(256, args.max_model_len // 2)
        params = SamplingParams(temperature=0, max_tokens=min(4 * args.overlap_steps + 8, args.max_model_len - prompt_len - 1),
                                ignore_eos=True)
        for i in range(args.overlap_batch):
            engine.add_request(f"overlap-{block_size}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params)
        while engine.last_step is None or engine.last_step.num_generation_tokens < args.overlap_batch \
                or engine.last_step.num_prompt_tokens:
            engine.step()  # until every sequence decodes
        times: dict[str, list[float]] = {"alone": [], "with_swap": []}
        for mode in ("alone", "with_swap", "alone", "with_swap"):  # interleaved
            runner.swap_blocks = with_pairs(inner, pairs) if mode == "with_swap" else inner  # type: ignore[method-assign]
            for _ in range(args.overlap_steps // 2):
                synchronize(runner.device)
                start = time.perf_counter()
                engine.step()
                synchronize(runner.device)
                times[mode].append(time.perf_counter() - start)
        runner.swap_blocks = inner  # type: ignore[method-assign]
        runner.take_swap_stats()
        swap_alone = []
        for _ in range(args.reps):
            synchronize(runner.device)
            start = time.perf_counter()
            runner.swap_space.swap(pairs, pairs)  # type: ignore[union-attr]
            runner.swap_space.synchronize()  # type: ignore[union-attr]
            swap_alone.append(time.perf_counter() - start)
        runner.swap_space.swap([], [])  # type: ignore[union-attr]
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
        bm.free(holder)
        step, with_swap, copies = (statistics.median(times["alone"]), statistics.median(times["with_swap"]),
                                   statistics.median(swap_alone))
        row = {"block_size": block_size, "batch": args.overlap_batch, "context_swapped": args.overlap_context,
               "step_ms": step * 1e3, "swap_ms": copies * 1e3, "step_with_swap_ms": with_swap * 1e3,
               "serial_ms": (step + copies) * 1e3, "hidden": (step + copies - with_swap) / min(step, copies)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def with_pairs(inner: Callable[[list[tuple[int, int]], list[tuple[int, int]]], None],
               pairs: list[tuple[int, int]]) -> Callable[[list[tuple[int, int]], list[tuple[int, int]]], None]:
    """The runner's per-step swap call, also moving `pairs` out and back in."""
    return lambda swap_out, swap_in: inner(swap_out + pairs, swap_in + pairs)


def crossovers(rows: list[dict[str, object]]) -> dict[int, int | None]:
    """Per block size, the shortest measured context from which swap wins at every longer one."""
    out: dict[int, int | None] = {}
    for block_size in sorted({int(r["block_size"]) for r in rows}):  # type: ignore[call-overload]
        mine = sorted((r for r in rows if r["block_size"] == block_size), key=lambda r: r["context"])  # type: ignore[arg-type, return-value]
        out[block_size] = None
        for i, r in enumerate(mine):
            if all(x["swap_wins"] for x in mine[i:]):
                out[block_size] = int(r["context"])  # type: ignore[call-overload]
                break
    return out


def served(args: argparse.Namespace, llm: LLM) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for block_size in args.served_block_sizes:
        use_block_size(llm, block_size)
        engine = llm.engine
        vocab = engine.runner.model_config.vocab_size
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(1, args.input_len + 1))}], warm)
        for mode in ("recompute", "swap"):
            engine.update_config({"preemption_mode": mode})
            rows.append(served_run(args, llm, vocab, f"{mode}-{block_size}"))
            rows[-1] = {"block_size": block_size, "mode": mode, **rows[-1]}
            print(json.dumps(rows[-1]), flush=True)
    return rows


def served_run(args: argparse.Namespace, llm: LLM, vocab: int, tag: str) -> dict[str, object]:
    """Requests arrive on the clock (Poisson) while the engine steps; the same prompts and arrival
    gaps for every configuration."""
    engine = llm.engine
    rng = random.Random(args.seed)
    gaps = [rng.expovariate(args.request_rate) for _ in range(args.num_prompts)]
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    sched = engine.scheduler
    preempted0, swapped0 = sched.num_preemptions, sched.num_swapped_out
    swap_bytes = swap_seconds = 0.0
    ttft, e2e = [], []
    start = time.time()
    due, added, finished = start, 0, 0
    while finished < args.num_prompts:
        now = time.time()
        while added < args.num_prompts and due + gaps[added] <= now:
            due += gaps[added]
            engine.add_request(f"{tag}-{added}", prompts[added], params, arrival_time=due)
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, due + gaps[added] - time.time()))
            continue
        for out in engine.step():
            if out.finished:
                finished += 1
                m = out.metrics
                assert m is not None and m.first_token_time is not None and m.finished_time is not None
                ttft.append(m.first_token_time - m.arrival_time)
                e2e.append(m.finished_time - m.arrival_time)
        stats = engine.last_step
        if stats is not None:
            swap_bytes += stats.swap_out_bytes + stats.swap_in_bytes
            swap_seconds += stats.swap_out_seconds + stats.swap_in_seconds
    duration = time.time() - start
    return {"served_req_s": args.num_prompts / duration, "output_tok_s": args.num_prompts * args.output_len / duration,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "e2e_p99_s": percentile(e2e, 99), "preemptions": sched.num_preemptions - preempted0,
            "swapped_out": sched.num_swapped_out - swapped0, "swap_GB": swap_bytes / 1e9,
            "swap_seconds": swap_seconds, "duration_s": duration}


def table(rows: list[dict[str, object]], columns: list[str]) -> str:
    def fmt(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    rates = copy_rates(device, args.copy_mib * MiB, args.reps)
    head = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "model": args.model, "kv_tokens": args.kv_tokens, "swap_space_gib": args.swap_space,
            "h2d_GBps": rates["h2d"] / 1e9, "d2h_GBps": rates["d2h"] / 1e9}
    print(json.dumps(head), flush=True)
    started = time.perf_counter()
    llm = make_llm(args)
    result: dict[str, object] = {**head, "engine_start_s": time.perf_counter() - started}
    print(json.dumps({"engine_start_s": result["engine_start_s"]}), flush=True)
    print(f"\nhost link (pinned, {args.copy_mib} MiB): H2D {head['h2d_GBps']:.1f} GB/s, D2H {head['d2h_GBps']:.1f} GB/s")
    if "per-sequence" in args.parts:
        rows = per_sequence(args, llm, rates)
        crossover = crossovers(rows)
        result.update(per_sequence=rows, crossover_context=crossover)
        print(table(rows, ["block_size", "context", "swap_ms", "swap_device_ms", "swap_GBps", "of_copy_rate",
                           "recompute_ms", "swap_us_per_token", "recompute_us_per_token", "swap_wins"]))
        print("crossover (shortest context from which swap wins):",
              ", ".join(f"block {b}: {c if c is not None else 'never'}" for b, c in crossover.items()))
    if "overlap" in args.parts:
        result["overlap"] = overlap(args, llm)
        print(table(result["overlap"], ["block_size", "batch", "context_swapped", "step_ms", "swap_ms",  # type: ignore[arg-type]
                                        "step_with_swap_ms", "serial_ms", "hidden"]))
    if "served" in args.parts:
        result["served"] = served(args, llm)
        print(table(result["served"], ["block_size", "mode", "served_req_s", "output_tok_s", "ttft_p50_s",  # type: ignore[arg-type]
                                       "ttft_p99_s", "e2e_p99_s", "preemptions", "swapped_out", "swap_GB", "swap_seconds"]))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
