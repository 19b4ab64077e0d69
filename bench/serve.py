"""`kvpilot bench serve`: load a running OpenAI-compatible server (kvpilot's or any other) at one
or several request rates, or at a fixed concurrency, and report TTFT, ITL and end-to-end latency
percentiles, throughput, errors and, under `--slo`, goodput; `--search` finds the highest rate
that meets the SLO. Flags are spelled as vLLM's `vllm bench serve`.

With `--output FILE`: JSON (`runs`: one entry per rate, see bench/summary.py, plus the server's
own gauges when it exposes vLLM's metric names; the autoscaling simulator reads this file as a
capacity curve) and a PNG beside it (latency percentiles and goodput against the rate).

`--search` starts at the first `--request-rate` (default 1 req/s), doubles it while the run meets
the SLO (halves it while it does not), then bisects `--search-steps` times between the highest
rate that met it and the lowest that did not. Every probe sends the same `--num-prompts` requests.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

from . import flags

_MAX_SEARCH_DOUBLINGS = 12
# RandomSpec's fields -> the flags that set them, for error lines
_FLAGS = {"num_prompts": "--num-prompts", "input_len": "--random-input-len", "output_len": "--random-output-len",
          "range_ratio": "--random-range-ratio", "prefix_len": "--random-prefix-len"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    g.add_argument("--model", default=None, help="the model name to send (default: the server's first in /v1/models)")
    g.add_argument("--api-key", default=None, help="Bearer key for the server (default: env OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=flags.positive_float, default=600.0, metavar="SECONDS")
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=flags.positive_int, default=200)
    g.add_argument("--dataset-path", type=Path, default=None, metavar="FILE",
                   help="local JSONL, one {\"prompt\" or \"prompt_token_ids\", optional \"output_len\"} per line, "
                        "or ShareGPT JSON, sampled as vLLM does (default: random token-id prompts)")
    g.add_argument("--tokenizer", type=flags.tokenizer_folder, default=None, metavar="FOLDER",
                   help="a local tokenizer folder (the served model's): counts a ShareGPT dataset's reply tokens")
    g.add_argument("--random-input-len", type=flags.positive_int, default=1024)
    g.add_argument("--random-output-len", type=flags.positive_int, default=128,
                   help="also the output length of dataset lines without one")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="sample lengths uniformly within len * (1 +- ratio)")
    g.add_argument("--random-prefix-len", type=flags.non_negative_int, default=0,
                   help="tokens of a prefix every random prompt shares")
    g.add_argument("--ignore-eos", action="store_true", help="ask for exactly the output length (vLLM's ignore_eos)")
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=flags.rate, nargs="+", default=[math.inf], metavar="RATE",
                   help="requests/s, one or several (each a run); inf sends every request at once")
    g.add_argument("--burstiness", type=flags.positive_float, default=1.0,
                   help="Gamma shape of the arrival gaps: 1 is Poisson, below 1 burstier")
    g.add_argument("--max-concurrency", type=flags.positive_int, default=None, help="at most this many requests in flight")
    g = parser.add_argument_group("SLO")
    g.add_argument("--slo", default=None, metavar="ttft=500ms,itl=50ms",
                   help="limits on ttft, itl (a request's mean gap) and e2e: goodput counts requests within them")
    g.add_argument("--search", action="store_true", help="find the highest rate whose P99 latencies meet --slo")
    g.add_argument("--search-steps", type=flags.positive_int, default=4, help="bisection steps of --search")
    g = parser.add_argument_group("output")
    g.add_argument("--output", type=Path, default=None, metavar="FILE", help="write JSON here and a PNG beside it")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from .slo import parse_slo
    from .workload import WorkloadError

    try:
        slo = parse_slo(args.slo) if args.slo else None
        if args.search and slo is None:
            raise ValueError("--search: needs --slo, the objective to search against")
        if args.search and len(args.request_rate) > 1:
            raise ValueError("--search: give at most one --request-rate, the rate to start from")
        requests = _requests(args)
    except (ValueError, WorkloadError) as e:
        print(f"kvpilot bench serve: error: {e}", file=sys.stderr)
        return 2
    try:
        body = asyncio.run(_bench(args, requests, slo))
    except _ServerError as e:
        print(f"kvpilot bench serve: error: {e}", file=sys.stderr)
        return 1
    if args.output:
        from .serve_report import write_outputs

        write_outputs(args.output, body)
        print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    return 0


class _ServerError(Exception):
    pass


def _requests(args: argparse.Namespace) -> list[Any]:
    from .workload import RandomSpec, WorkloadError, lazy_encoder, load_dataset, random_requests

    if args.dataset_path is not None:
        return load_dataset(args.dataset_path, args.num_prompts, args.random_output_len, args.seed,
                            lazy_encoder(args.tokenizer))
    try:
        spec = RandomSpec(args.num_prompts, args.random_input_len, args.random_output_len,
                          args.random_range_ratio, args.random_prefix_len)
    except WorkloadError as e:
        field, _, rest = str(e).partition(":")
        raise WorkloadError(f"{_FLAGS.get(field, field)}:{rest}") from None
    return random_requests(spec, args.seed)


async def _bench(args: argparse.Namespace, requests: list[Any], slo: Any) -> dict[str, Any]:
    import os

    from tqdm import tqdm

    from .loadgen import LoadConfig, run_load
    from .server_gauges import GaugeSampler
    from .summary import format_summary, summarize

    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    model = args.model or await _served_model(args.base_url, api_key)

    async def probe(rate: float) -> dict[str, Any]:
        config = LoadConfig(args.base_url, model, rate, args.burstiness, args.max_concurrency, api_key,
                            args.ignore_eos, args.request_timeout, args.seed)
        label = "inf" if math.isinf(rate) else f"{rate:g}"
        with tqdm(total=len(requests), desc=f"rate {label} req/s", unit="req", disable=args.disable_tqdm,
                  file=sys.stderr) as bar:
            async with GaugeSampler(args.base_url, api_key=api_key) as gauges:
                load = await run_load(config, requests, progress=bar.update)
        summary = summarize(load.results, load.duration_s, rate, slo)
        summary.update(gauges.summary())
        if args.max_concurrency:
            summary["max_concurrency"] = args.max_concurrency
        print(format_summary(summary), flush=True)
        return summary

    runs: list[dict[str, Any]] = []
    search: dict[str, Any] | None = None
    if args.search:
        search = await _search(probe, runs, args.request_rate[0], slo, args.search_steps)
    else:
        for rate in args.request_rate:
            runs.append(await probe(rate))
    body: dict[str, Any] = {
        "command": ["kvpilot", *sys.argv[1:]],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "base_url": args.base_url, "model": model,
        "description": f"{model} at {args.base_url}",
        "workload": {"num_prompts": args.num_prompts,
                     "dataset_path": str(args.dataset_path) if args.dataset_path else None,
                     "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
                     "random_range_ratio": args.random_range_ratio, "random_prefix_len": args.random_prefix_len,
                     "ignore_eos": args.ignore_eos, "burstiness": args.burstiness,
                     "max_concurrency": args.max_concurrency, "seed": args.seed},
        "slo": slo.describe() if slo else None,
        "runs": sorted(runs, key=lambda r: math.inf if r["request_rate"] == "inf" else r["request_rate"]),
    }
    if search is not None:
        body["search"] = search
        best = search["highest_rate_meeting_slo"]
        print(f"highest rate meeting the SLO ({slo.describe()}): "
              f"{'none of the rates tried' if best is None else f'{best:g} req/s'}")
    return body


async def _search(probe: Any, runs: list[dict[str, Any]], start: float, slo: Any, steps: int) -> dict[str, Any]:
    rate = 1.0 if math.isinf(start) else start
    met: float | None = None
    missed: float | None = None
    for _ in range(_MAX_SEARCH_DOUBLINGS):
        summary = await probe(rate)
        runs.append(summary)
        if summary["meets_slo"]:
            met = rate
            if missed is not None:
                break
            rate *= 2
        else:
            missed = rate
            if met is not None:
                break
            rate /= 2
    if met is not None and missed is not None:
        for _ in range(steps):
            rate = (met + missed) / 2
            summary = await probe(rate)
            runs.append(summary)
            if summary["meets_slo"]:
                met = rate
            else:
                missed = rate
    return {"slo": slo.describe(), "highest_rate_meeting_slo": met, "lowest_rate_missing_slo": missed,
            "probes": [r["request_rate"] for r in runs]}


async def _served_model(base_url: str, api_key: str | None) -> str:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with aiohttp.ClientSession(headers=headers) as session, \
                session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
            if response.status != 200:
                raise _ServerError(f"GET {url} answered HTTP {response.status}; pass --model")
            data = (await response.json()).get("data") or []
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise _ServerError(f"cannot reach the server at {base_url} ({type(e).__name__}: {e})") from None
    if not data:
        raise _ServerError(f"GET {url} lists no model; pass --model")
    return str(data[0]["id"])
