"""`kvpilot bench throughput`: offline throughput of `LLM.generate` on any model or preset (with
`--load-format dummy`, no weights needed), on random token-id prompts of fixed or sampled lengths
or a local JSONL dataset, every request to its full output length (EOS ignored, as vLLM's
benchmark does).

Prints requests/s, total and output tokens/s, and the decode step against its bandwidth floor:
a decode-only step must read every weight (but the input embedding, of which it reads only its
tokens' rows) and each running sequence's KV once, so its floor is those bytes over the device's
copy rate (measured in the same run: a large device-to-device copy, bytes read plus written per
second). Steps are timed by the engine itself (`last_step`), so the figure is the step as
`LLM.generate` ran it. With `--output FILE`: JSON, and a PNG beside it of the decode step time
against batch size with the floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvpilot.runtime.args import add_engine_arguments

from . import flags

_MIN_STEPS = 5  # decode steps a batch size needs before its median is reported


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=flags.positive_int, default=1000)
    g.add_argument("--input-len", type=flags.positive_int, default=256)
    g.add_argument("--output-len", type=flags.positive_int, default=256,
                   help="also the output length of dataset lines without one")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="sample lengths uniformly within len * (1 +- ratio)")
    g.add_argument("--dataset-path", type=Path, default=None, metavar="FILE",
                   help="local JSONL, one {\"prompt\" or \"prompt_token_ids\", optional \"output_len\"} per line, "
                        "or ShareGPT JSON, sampled as vLLM does (its tokens counted by the model's tokenizer)")
    g.add_argument("--output", type=Path, default=None, metavar="FILE", help="write JSON here and a PNG beside it")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpilot.runtime import LLM
    from kvpilot.runtime.args import EngineArgs
    from kvpilot.runtime.model_source import ModelSourceError, resolve_model

    from .workload import RandomSpec, WorkloadError, lazy_encoder, load_dataset, random_requests

    try:
        if args.dataset_path is not None:
            tokenizer = resolve_model(args.model, args.load_format, args.tokenizer).tokenizer
            requests = load_dataset(args.dataset_path, args.num_prompts, args.output_len, args.seed,
                                    lazy_encoder(tokenizer))
        else:
            try:
                spec = RandomSpec(args.num_prompts, args.input_len, args.output_len, args.random_range_ratio)
            except WorkloadError as e:
                field, _, rest = str(e).partition(":")
                raise WorkloadError(f"--{'random-' if field == 'range_ratio' else ''}{field.replace('_', '-')}:{rest}") from None
            requests = random_requests(spec, args.seed)
        engine_args = EngineArgs.from_cli(args)
        started = time.perf_counter()
        llm = LLM.from_engine_args(engine_args)
        _check_fits(llm, requests)
    except (ValueError, ModelSourceError) as e:
        print(f"kvpilot bench throughput: error: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - started
    result = measure(llm, requests, disable_tqdm=args.disable_tqdm)
    result.update({"command": ["kvpilot", *sys.argv[1:]], "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   "model": engine_args.model or "embedded SmolLM2-135M-Instruct",
                   "load_format": engine_args.load_format, "device": llm.engine.config.device.device,
                   "engine_start_s": load_s,
                   "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                                "output_len": args.output_len, "random_range_ratio": args.random_range_ratio,
                                "dataset_path": str(args.dataset_path) if args.dataset_path else None,
                                "seed": args.seed}})
    print(format_result(result))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        _plot(result, args.output.with_suffix(".png"))
        print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    return 0


def _check_fits(llm: Any, requests: list[Any]) -> None:
    max_len = llm.engine.config.model.max_model_len
    longest = max((r.prompt_len or 0) + r.output_len for r in requests)
    if longest > max_len:
        raise ValueError(f"a request needs {longest} tokens (input + output) but the context is {max_len}; "
                         f"shorten --input-len/--output-len or raise --max-model-len")


def measure(llm: Any, requests: list[Any], disable_tqdm: bool = True) -> dict[str, Any]:
    """Runs `llm.generate` on the requests once (after a warm-up) and times every engine step."""
    from tqdm import tqdm

    from kvpilot.runtime import SamplingParams

    engine = llm.engine
    llm.generate([{"prompt_token_ids": [100, 101, 102, 103]}], SamplingParams(max_tokens=4, ignore_eos=True))
    prompts = [{"prompt_token_ids": r.prompt} if isinstance(r.prompt, list) else r.prompt for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    decode_steps: dict[int, list[tuple[float, int]]] = defaultdict(list)  # batch -> (seconds, KV tokens read)
    inner = engine.step

    with tqdm(total=len(requests), unit="req", disable=disable_tqdm, file=sys.stderr) as bar:
        def step(finished_only: bool = False) -> list[Any]:
            context = sum(seq.num_tokens for seq in engine.scheduler.running)
            outputs = inner(finished_only=finished_only)
            stats = engine.last_step
            if stats is not None and stats.num_batched_tokens == stats.num_generation_tokens and stats.num_prompt_tokens == 0:
                decode_steps[stats.num_generation_tokens].append((stats.duration_s, context))
            bar.update(sum(1 for out in outputs if out.finished))
            return outputs

        engine.step = step
        try:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
        finally:
            del engine.step
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    rate = copy_rate(engine.config.device.device)
    runner = engine.runner
    weight_bytes = runner.model.streamed_weight_bytes()
    kv_per_token = runner.bytes_per_block // engine.config.cache.block_size
    steps = []
    for batch, timed in sorted(decode_steps.items()):
        if len(timed) < _MIN_STEPS:
            continue
        context = statistics.fmean(c for _, c in timed)
        floor = (weight_bytes + context * kv_per_token) / rate
        median = statistics.median(t for t, _ in timed)
        steps.append({"batch": batch, "num_steps": len(timed), "median_ms": 1e3 * median,
                      "mean_kv_tokens": context, "floor_ms": 1e3 * floor, "of_floor": median / floor})
    return {
        "num_requests": len(outputs), "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "copy_rate_bytes_per_s": rate, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
        "decode_steps": steps,
    }


def copy_rate(device: str) -> float:
    """Bytes read + written per second by a large copy on `device`: the memory traffic ceiling."""
    import torch

    numel = (1 << 28) if device == "cuda" else (1 << 25)  # 512 MiB / 64 MiB of bf16/fp32 halves
    src = torch.ones(numel, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times[2:])


def format_result(result: dict[str, Any]) -> str:
    lines = [f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.1f} total "
             f"tokens/s, {result['output_tokens_per_s']:.1f} output tokens/s "
             f"({result['num_requests']} requests in {result['elapsed_s']:.2f} s)",
             f"Decode step against its bandwidth floor (weights streamed {result['weight_bytes'] / 2**30:.2f} GiB + KV read, "
             f"at {result['copy_rate_bytes_per_s'] / 1e9:.0f} GB/s copy rate):",
             f"{'batch':>7}{'steps':>8}{'median ms':>12}{'floor ms':>11}{'x floor':>9}{'ms/token':>10}"]
    for s in result["decode_steps"]:
        lines.append(f"{s['batch']:>7}{s['num_steps']:>8}{s['median_ms']:>12.2f}{s['floor_ms']:>11.2f}"
                     f"{s['of_floor']:>9.2f}{s['median_ms'] / s['batch']:>10.3f}")
    if not result["decode_steps"]:
        lines.append(f"  (no batch size ran {_MIN_STEPS} decode-only steps)")
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["decode_steps"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([s["batch"] for s in steps], [s["median_ms"] for s in steps], marker="o", label="decode step (median)")
    ax.plot([s["batch"] for s in steps], [s["floor_ms"] for s in steps], linestyle="--", label="bandwidth floor")
    ax.set_xlabel("batch (sequences decoding)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{result['model']}: {result['total_tokens_per_s']:.0f} total tok/s, "
                 f"{result['output_tokens_per_s']:.0f} output tok/s", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
