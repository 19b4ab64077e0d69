"""`kvpilot bench autotune`: is live re-tuning worth it? A phased workload (bench/autotune_workload.py)
is sent, request for request and second for second, to a fresh `kvpilot serve` for every static
configuration of a grid (each `--block-sizes` x `--preemption-modes` x `--max-num-seqs` x
`--max-num-batched-tokens`, or the `--configs` given), then to fresh ones run by the autotuner
(bench/autotune_loop.py: the operator's own tuning step, canary included, started in the policy's
calm configuration with the grid's largest batch limits, which it may move within the grid's
range). `--repeats N` runs every configuration, static and autotuned, N times, each on a fresh
server: the verdicts use each configuration's mean and report the spread of its goodput, P99 TTFT
and per-phase goodput. Every server gets the same KV budget in tokens (`--kv-tokens`, as
`--num-gpu-blocks-override` of budget / block size), small enough that memory pressure is real.
The objective is the operator's: goodput under `--slo`, which is also the tuner's
`spec.autotune.slo`.

`--screen SECONDS` screens the grid instead: every static configuration on each phase alone, in
steady state (the phase's arrivals for SECONDS, the phases one after another on one server per
configuration with the queue drained between them), to find each phase's best configurations
before the full runs are spent on the ones that matter.

Per phase and overall: goodput (requests meeting `--slo` per second of the workload), SLO
attainment, P99 TTFT, ITL and end-to-end latency, failed requests, preemptions and swap traffic
(from the server's counters), and for the autotuner every switch with the pause it caused. The
autotuner's greedy outputs are compared with the unswitched default's (block size 16, recompute)
request by request. JSON (`--output`), a table, and a PNG of latency over time with the switches
marked; each server's log goes to `autotune-logs/` beside the JSON (else under the temp folder). The tuner's timescales (`--interval`, `--cooldown`, `--min-dwell`) are compressed from the
operator's production defaults so that a phase of minutes can be tuned at all.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from kvpilot.runtime.tunables import (
    BLOCK_SIZE,
    BLOCK_SIZES,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PREEMPTION_MODE,
    PREEMPTION_MODES,
)

from . import flags
from .autotune_run import Knobs, RunPlan, one_run

# flags this benchmark sets on every server itself
_OWN_FLAGS = ("--block-size", "--preemption-mode", "--num-gpu-blocks-override", "--port", "--host", "--admin-token")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload and servers")
    g.add_argument("--workload", type=Path, default=None, metavar="FILE",
                   help="phases as YAML (see bench/autotune_workload.py); default: calm, burst, long")
    g.add_argument("--quick", action="store_true",
                   help="a CI-sized run: the short built-in workload, blocks 8 and 16, fast tuner timescales, "
                        "a CPU-sized KV budget and SLO (each still overridable)")
    g.add_argument("--serve-args", default="", metavar="FLAGS",
                   help="flags for every kvpilot serve, e.g. \"--model llama-3-8b --load-format dummy\" (default "
                        "--max-model-len: the workload's longest request rounded up to a power of two)")
    g.add_argument("--kv-tokens", type=flags.positive_int, default=None,
                   help="KV budget of every server in tokens (default: 65536; 1024 with --quick)")
    g.add_argument("--block-sizes", type=flags.tunable(BLOCK_SIZE), nargs="+", default=None, choices=BLOCK_SIZES,
                   help="the grid's block sizes, also the tuner's allowed ones (default: 8 16 32; 8 16 with --quick)")
    g.add_argument("--preemption-modes", nargs="+", default=list(PREEMPTION_MODES), choices=PREEMPTION_MODES)
    g.add_argument("--max-num-seqs", type=flags.tunable(MAX_NUM_SEQS), nargs="+", default=None, metavar="N",
                   help="the grid's max_num_seqs values, whose range the tuner may move it in (default: the "
                        "server's own, not tuned)")
    g.add_argument("--max-num-batched-tokens", type=flags.tunable(MAX_NUM_BATCHED_TOKENS), nargs="+", default=None, metavar="N",
                   help="the grid's max_num_batched_tokens values, whose range the tuner may move it in (default: "
                        "the server's own, not tuned)")
    g.add_argument("--configs", nargs="+", default=None, metavar="BLOCK/MODE[/SEQS][/TOKENS]",
                   help="the static runs, e.g. 16/recompute 8/swap/64/1024 (default: the whole grid), with a value "
                        "for each batch limit the grid has; each must lie within the grid's values, which stay the "
                        "tuner's allowed ones")
    g.add_argument("--repeats", type=flags.positive_int, default=1,
                   help="runs of every configuration, static and autotuned, each on a fresh server")
    g.add_argument("--screen", type=flags.positive_float, default=None, metavar="SECONDS",
                   help="screen the grid instead: each static configuration on each phase alone for SECONDS")
    g.add_argument("--slo", default=None, metavar="ttft=500ms,itl=50ms",
                   help="goodput's objective (default: ttft=500ms,itl=50ms; ttft=3s,itl=1s with --quick)")
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("the autotuner (the operator's spec.autotune)")
    g.add_argument("--interval", type=flags.positive_float, default=None, metavar="SECONDS",
                   help="scrape and decide this often (default 5; 1 with --quick)")
    g.add_argument("--cooldown", type=float, default=None, metavar="SECONDS",
                   help="least time between two changes (default 30; 4 with --quick)")
    g.add_argument("--min-dwell", type=float, default=None, metavar="SECONDS",
                   help="data needed under the config in force before a decision (default 10; 2 with --quick)")
    g.add_argument("--queue-depth-high", type=float, default=None,
                   help="waiting sequences that mean pressure (default 100, the article's; 6 with --quick)")
    g.add_argument("--queue-depth-low", type=float, default=None,
                   help="below this (and the preemption low level) pressure ends (default 50; 2 with --quick)")
    g.add_argument("--canary-window", type=flags.positive_float, default=None, metavar="SECONDS",
                   help="how long a change is tried before it is judged, and the saturated time a configuration "
                        "needs before its measured throughput steers the policy (the operator's canary.window; "
                        "default 20; 4 with --quick); the canary times out at 3 times it")
    g.add_argument("--canary-min-requests", type=flags.positive_int, default=None, metavar="N",
                   help="finished requests a canary needs on each side to be judged (default 20; 2 with --quick)")
    g.add_argument("--preemptions-high", type=float, default=1.0, metavar="PER_S")
    g.add_argument("--preemptions-low", type=float, default=0.1, metavar="PER_S")
    g = parser.add_argument_group("output")
    g.add_argument("--output", type=Path, default=None, metavar="FILE", help="write JSON here and a PNG beside it")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _defaults(args: argparse.Namespace) -> None:
    quick = args.quick
    for name, normal, small in (("kv_tokens", 65536, 1024), ("block_sizes", [8, 16, 32], [8, 16]),
                                ("slo", "ttft=500ms,itl=50ms", "ttft=3s,itl=1s"), ("interval", 5.0, 1.0),
                                ("cooldown", 30.0, 4.0), ("min_dwell", 10.0, 2.0), ("canary_window", 20.0, 4.0),
                                ("canary_min_requests", 20, 2),
                                ("queue_depth_high", 100.0, 6.0), ("queue_depth_low", 50.0, 2.0)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else normal)


def run(args: argparse.Namespace) -> int:
    from kvpilot.operator.autotune import CanarySpec, KnobRange, SloTargets, Thresholds, TuningSpec

    from .autotune_workload import DEFAULT, QUICK, WorkloadFileError, build_requests, load_phases
    from .slo import parse_slo

    _defaults(args)
    try:
        phases = load_phases(args.workload) if args.workload else (QUICK if args.quick else DEFAULT)
        slo = parse_slo(args.slo)
        serve_flags = _serve_flags(args.serve_args, args.max_num_seqs, args.max_num_batched_tokens)
        block_sizes = sorted(set(args.block_sizes))
        modes = list(dict.fromkeys(args.preemption_modes))
        for b in block_sizes:
            if args.kv_tokens < b * 2:
                raise ValueError(f"--kv-tokens: {args.kv_tokens} tokens are under two blocks of {b}")
        seqs, tokens = _sorted(args.max_num_seqs), _sorted(args.max_num_batched_tokens)
        statics = _static_configs(args.configs, block_sizes, modes, seqs, tokens)
        longest = max(p.max_tokens for p in phases)
        if longest > args.kv_tokens:
            raise ValueError(f"--kv-tokens: {args.kv_tokens} cannot hold the workload's longest request "
                             f"({longest} tokens); raise it or shorten the phases")
        spec = TuningSpec(
            enabled=True, interval_s=args.interval, allowed_block_sizes=tuple(block_sizes),
            allowed_preemption_modes=tuple(modes),
            thresholds=Thresholds(queue_depth_high=args.queue_depth_high, queue_depth_low=args.queue_depth_low,
                                  preemptions_per_s_high=args.preemptions_high,
                                  preemptions_per_s_low=args.preemptions_low),
            slo=SloTargets(ttft_p99_s=slo.ttft_s, itl_p99_s=slo.itl_s),
            max_num_seqs=KnobRange(seqs[0], seqs[-1]) if len(seqs) > 1 else None,
            max_num_batched_tokens=KnobRange(tokens[0], tokens[-1]) if len(tokens) > 1 else None,
            cooldown_s=args.cooldown, min_dwell_s=args.min_dwell,
            canary=CanarySpec(window_s=args.canary_window, timeout_s=3 * args.canary_window,
                              min_requests=args.canary_min_requests))
    except ValueError as e:  # WorkloadFileError included
        message = str(e)
        if not message.startswith("--") and not isinstance(e, WorkloadFileError):
            message = f"--{message}" if message.startswith("slo:") else message
        print(f"kvpilot bench autotune: error: {message}", file=sys.stderr)
        return 2
    if not any(f.split("=")[0] == "--max-model-len" for f in serve_flags):
        # the engine needs its cache to hold one full-length sequence; the workload needs no more
        serve_flags += ["--max-model-len", str(min(args.kv_tokens, 1 << math.ceil(math.log2(longest))))]
    if args.screen is not None:
        phases = tuple(dataclasses.replace(p, duration=args.screen) for p in phases)
    timed = build_requests(phases, args.seed)
    plans = [RunPlan(f"static {k.name}", k, False, i, args.repeats) for k in statics for i in range(args.repeats)]
    if args.screen is None:
        calm = _calm_within(spec)
        start = Knobs(calm[0], calm[1], seqs[-1] if seqs else None, tokens[-1] if tokens else None)
        plans += [RunPlan("autotuner", start, True, i, args.repeats) for i in range(args.repeats)]
    from .server_process import ServerStartError

    try:
        runs = asyncio.run(_run_all(args, plans, phases, timed, serve_flags, spec, slo))
    except ServerStartError as e:
        print(f"kvpilot bench autotune: error: {e}", file=sys.stderr)
        return 1
    from .autotune_report import build_body, print_table, write_outputs

    body = build_body(args, phases, slo, spec, runs, timed, _baseline(statics))
    print_table(body)
    if args.output:
        write_outputs(args.output, body)
        print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    return 0


def _sorted(values: list[int] | None) -> list[int]:
    return sorted(set(values or ()))


def _static_configs(given: list[str] | None, block_sizes: list[int], modes: list[str], seqs: list[int],
                    tokens: list[int]) -> list[Knobs]:
    """The grid's configurations, or those `--configs` names (each within the grid's values)."""
    if given is None:
        grid: tuple[list[int | None], list[int | None]] = (list(seqs) or [None], list(tokens) or [None])
        return [Knobs(b, m, s, t) for b in block_sizes for m in modes for s in grid[0] for t in grid[1]]
    gridded = [name for name, grid in (("SEQS", seqs), ("TOKENS", tokens)) if grid]
    out: list[Knobs] = []
    for text in given:
        parts = text.split("/")
        rule = (f"--configs: {text!r} is not {'/'.join(['BLOCK', 'MODE', *gridded])} with BLOCK in --block-sizes "
                f"{block_sizes} and MODE in --preemption-modes {modes}"
                + (f", SEQS in --max-num-seqs {seqs}" if seqs else "")
                + (f", TOKENS in --max-num-batched-tokens {tokens}" if tokens else ""))
        if len(parts) != 2 + len(gridded) or not all(p.isdigit() for p in [parts[0], *parts[2:]]):
            raise ValueError(rule)
        limits = dict(zip(gridded, (int(p) for p in parts[2:]), strict=True))
        knobs = Knobs(int(parts[0]), parts[1], limits.get("SEQS"), limits.get("TOKENS"))
        if knobs.block_size not in block_sizes or knobs.preemption_mode not in modes or \
                limits.get("SEQS", seqs[0] if seqs else 0) not in (seqs or [0]) or \
                limits.get("TOKENS", tokens[0] if tokens else 0) not in (tokens or [0]):
            raise ValueError(rule)
        if knobs not in out:
            out.append(knobs)
    return out


def _baseline(statics: list[Knobs]) -> str | None:
    """The unswitched default the verdicts compare with: the contract's default block size and
    preemption mode, the largest batch limits of the grid (the engine's own defaults are its
    largest), if the grid ran it."""
    defaults = (BLOCK_SIZE.default, PREEMPTION_MODE.default)
    default = [k for k in statics if (k.block_size, k.preemption_mode) == defaults]
    if not default:
        return None
    return f"static {max(default, key=lambda k: (k.max_num_seqs or 0, k.max_num_batched_tokens or 0)).name}"


def _calm_within(spec: Any) -> tuple[int, str]:
    """The policy's calm config, moved onto what the grid allows (as the policy itself does)."""
    block = min(spec.allowed_block_sizes, key=lambda b: (abs(math.log2(b) - math.log2(spec.calm.block_size)), b))
    mode = spec.calm.preemption_mode if spec.calm.preemption_mode in spec.allowed_preemption_modes \
        else spec.allowed_preemption_modes[0]
    return block, mode


def _serve_flags(text: str, seqs: list[int] | None = None, tokens: list[int] | None = None) -> list[str]:
    from kvpilot.runtime.cli import build_parser

    try:
        flags_ = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"--serve-args: {e}") from None
    own = _OWN_FLAGS + tuple(f for f, grid in (("--max-num-seqs", seqs), ("--max-num-batched-tokens", tokens)) if grid)
    for flag in flags_:
        if flag.split("=")[0] in own:
            raise ValueError(f"--serve-args: {flag.split('=')[0]} is set by the benchmark for each server")
    try:
        build_parser().parse_args(["serve", *flags_])
    except SystemExit:
        raise ValueError(f"--serve-args: kvpilot serve rejects {text!r} (see kvpilot serve --help)") from None
    return flags_


async def _run_all(args: argparse.Namespace, plans: list[RunPlan], phases: Any, timed: list[Any],
                   serve_flags: list[str], spec: Any, slo: Any) -> list[dict[str, Any]]:
    from tqdm import tqdm

    total = len(timed) * len(plans)
    runs = []
    with tqdm(total=total, unit="req", disable=args.disable_tqdm, file=sys.stderr) as bar:
        for plan in plans:
            bar.set_description(plan.name)
            runs.append(await one_run(args, plan, timed, serve_flags, spec, bar.update))
    return runs
