"""The GPU capacity curve that `kvpilot bench autoscale` simulates a fleet from, measured from
sustained runs: `kvpilot serve` (Llama-3-8B shape, dummy bf16 weights, the served configuration of
benchmarks/RESULTS.md) loaded by `kvpilot bench serve` with --num-prompts requests at each rate
(512 tokens in, 256 out, EOS ignored, Poisson arrivals), after a discarded warm-up round; then the
fleet simulator's self-check on the curve.

Checked: every request of every run answered with its 256 tokens and no error; the self-check
(one simulated replica reproduces each point's latency percentiles and throughput within 10%).
Timed: each rate's throughput, TTFT, ITL and E2E percentiles, the server's mean queue, running
requests and KV-cache usage. Writes DIR/autoscale-capacity-curve.json (bench serve's file, which
`kvpilot bench autoscale --capacity-curve` reads), its PNG, the server's log and DIR/check.json;
prints a table last. About 6 minutes on one H200 with the defaults.

Usage: python3 benchmarks/autoscale_curve_gpu.py --out DIR [--num-prompts 1000]
           [--request-rate 12 20 26 30 34 38 inf] [--server-flags "..."] [--input-len 512 --output-len 256]
(the last two only to try it on a smaller server, e.g. the embedded model on a CPU)
Needs what `kvpilot serve` and `kvpilot bench serve` import (fastapi, uvicorn, pydantic, pyzmq,
msgspec, aiohttp, tqdm, matplotlib). Without an install the repository's folders are linked
under a temporary `kvpilot` package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = "--model llama-3-8b --load-format dummy --max-num-seqs 256 --max-num-batched-tokens 8192 --disable-log-stats"


def _importable() -> None:
    """Makes `kvpilot.*` importable here and in the server's process without an install."""
    try:
        import kvpilot.bench  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp()) / "kvpilot"
        shim.mkdir()
        for part in ("runtime", "kernels", "operator", "bench"):
            (shim / part).symlink_to(ROOT / part)
        sys.path.insert(0, str(shim.parent))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")]))


def bench_serve(argv: list[str]) -> int:
    from kvpilot.bench import serve

    parser = argparse.ArgumentParser(prog="kvpilot bench serve")
    serve.add_arguments(parser)
    return serve.run(parser.parse_args(argv))


async def measure(args: argparse.Namespace) -> Path:
    from kvpilot.bench.server_process import serve

    out, curve = args.out, args.out / "autoscale-capacity-curve.json"
    workload = ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                "--ignore-eos", "--disable-tqdm"]
    started = time.monotonic()
    async with serve(shlex.split(args.server_flags), out / "serve.log") as base:
        print(f"kvpilot serve ready in {time.monotonic() - started:.1f} s at {base}", flush=True)
        # the first round after a start pays the kernels' compilation: measured, then dropped
        warm = await asyncio.to_thread(bench_serve, ["--base-url", base, *workload, "--num-prompts",
                                                     str(min(200, args.num_prompts)), "--seed", "1",
                                                     "--request-rate", args.request_rate[0]])
        if warm != 0:
            raise SystemExit(f"the warm-up run failed ({warm})")
        code = await asyncio.to_thread(bench_serve, [
            "--base-url", base, *workload, "--num-prompts", str(args.num_prompts), "--seed", "0",
            "--request-rate", *args.request_rate, "--slo", "ttft=500ms,itl=50ms", "--output", str(curve)])
        if code != 0:
            raise SystemExit(f"kvpilot bench serve failed ({code})")
    return curve


def check(curve_path: Path, num_prompts: int, output_len: int = 256) -> dict[str, object]:
    from kvpilot.bench.capacity_curve import CurveError, load_curve
    from kvpilot.bench.fleet_inputs import SimConfig
    from kvpilot.bench.self_check import self_check

    runs = json.loads(curve_path.read_text())["runs"]
    lost = [(r["request_rate"], r["failed"], r["errors"]) for r in runs
            if r["failed"] or r["completed"] != num_prompts or r["total_output_tokens"] != num_prompts * output_len]
    try:
        curve = load_curve(curve_path)
    except CurveError as e:
        print(f"the curve cannot be simulated: {e}")
        return {"lost": lost, "self_check_passed": False, "error": str(e)}
    result = self_check(curve, SimConfig(slo_ttft_s=0.5), 20_000)
    errors = {row.request_rate: row.max_error for row in result.rows}
    print(f"\n{'req/s':>6} {'done/s':>7} {'TTFT P50':>9} {'TTFT P99':>9} {'ITL P99':>8} {'E2E P50':>8} {'waiting':>8} "
          f"{'running':>8} {'KV':>6} {'self-check':>10}")
    for r in runs:
        rate = r["request_rate"]
        err = errors.get(rate if rate == "inf" else float(rate))
        print(f"{rate!s:>6} {r['request_throughput']:>7.2f} {1e3 * r['ttft']['p50']:>7.0f}ms {1e3 * r['ttft']['p99']:>7.0f}ms "
              f"{1e3 * r['itl']['p99']:>6.1f}ms {r['e2e']['p50']:>7.2f}s {r.get('num_requests_waiting', 0):>8.2f} "
              f"{r.get('num_requests_running', 0):>8.1f} {r.get('kv_cache_usage', 0):>6.3f} "
              f"{'-' if err is None else f'{err:.1%}':>10}")
    print(f"capacity {curve.capacity:.2f} req/s; P99 TTFT <= 500 ms up to {curve.highest_rate_within(0.5)} req/s; "
          f"{result.describe()}")
    print(f"every request answered with {output_len} tokens: {'yes' if not lost else f'NO: {lost}'}")
    return {"lost": lost, "self_check_passed": result.passed, "self_check_max_error": result.max_error,
            "capacity": curve.capacity, "slo_rate": curve.highest_rate_within(0.5)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the curve, its PNG, the logs")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests a rate (sustained: 1,000 or more)")
    parser.add_argument("--request-rate", nargs="+", default=["12", "20", "26", "30", "34", "38", "inf"])
    parser.add_argument("--server-flags", default=SERVER, help="kvpilot serve's flags")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()
    _importable()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    curve = asyncio.run(measure(args))
    verdict = check(curve, args.num_prompts, args.output_len)
    (args.out / "check.json").write_text(json.dumps(verdict, indent=1) + "\n")
    print(f"{time.monotonic() - started:.0f} s in all")
    return 0 if not verdict["lost"] and verdict["self_check_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
