"""Served against offline on the CPU (embedded SmolLM2): 16 concurrent streams x 64 tokens sent by
`kvpilot bench serve`'s load generator to a `kvpilot serve` process, against `LLM.generate` on
the same prompts in this process. Served and offline rounds alternate (the server idles while
`LLM.generate` runs, and the other way round), so each pair meets the same spell of a shared VM;
the ratio reported is the median of the pairs'.

16 random token-id prompts of 8-100 tokens, 64 new tokens each (greedy, EOS ignored), one warm-up
round each side, then --repeats rounds of each. The served side's output tok/s
counts from the first request sent to the last token received, as bench serve does.

Usage: PYTHONSAFEPATH=1 .venv/bin/python benchmarks/bench_serve_cpu.py [--repeats 3] [--output FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpilot.bench.loadgen import LoadConfig, run_load
from kvpilot.bench.server_process import serve
from kvpilot.bench.summary import summarize
from kvpilot.bench.workload import BenchRequest, RandomSpec, random_requests

NUM_STREAMS, NEW_TOKENS = 16, 64
MODEL = "SmolLM2-135M-Instruct"
SERVER_FLAGS = ["--max-model-len", "1024", "--disable-log-stats", "--log-level", "warning"]


async def served(base: str, requests: list[BenchRequest]) -> dict[str, Any]:
    """One round through bench serve's load generator, all streams at once."""
    config = LoadConfig(base, MODEL, max_concurrency=NUM_STREAMS, ignore_eos=True)
    load = await run_load(config, requests)
    summary = summarize(load.results, load.duration_s, float("inf"))
    assert summary["completed"] == NUM_STREAMS, summary["errors"]
    assert summary["total_output_tokens"] == NUM_STREAMS * NEW_TOKENS
    return summary


class Offline:
    def __init__(self) -> None:
        from kvpilot.runtime import LLM, SamplingParams

        self.llm = LLM(max_model_len=1024)
        self.params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(self, requests: list) -> float:
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": r.prompt} for r in requests], self.params)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outs) == NUM_STREAMS * NEW_TOKENS
        return NUM_STREAMS * NEW_TOKENS / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    requests = random_requests(RandomSpec(NUM_STREAMS, 54, NEW_TOKENS, range_ratio=0.85), seed=0)
    requests = [type(r)(r.prompt, r.prompt_len, NEW_TOKENS) for r in requests]  # lengths vary in, not out
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the kvpilot command sets it for the server
    log = Path(tempfile.gettempdir()) / "bench_serve_cpu.server.log"
    serve_runs: list[dict[str, Any]] = []
    offline_rates: list[float] = []
    # The server's event loop runs only while a served round does: LLM.generate runs on this
    # (main) thread between them, as a user's offline call would.
    with asyncio.Runner() as loop:
        stack = contextlib.AsyncExitStack()
        try:
            base = loop.run(stack.enter_async_context(serve(SERVER_FLAGS, log, startup_timeout_s=300)))
            offline = Offline()
            for i in range(args.repeats + 1):  # the rounds alternate, so both sides share the VM's spells
                summary, rate = loop.run(served(base, requests)), offline.run(requests)
                if i:  # the first round of each warms it up
                    serve_runs.append(summary)
                    offline_rates.append(rate)
                    print(json.dumps({"served_output_tok_s": summary["output_throughput"],
                                      "offline_output_tok_s": rate, "ttft_p50_ms": 1e3 * summary["ttft"]["p50"],
                                      "itl_p50_ms": 1e3 * summary["itl"]["p50"]}), flush=True)
        finally:
            loop.run(stack.aclose())
    served_rate = statistics.median(r["output_throughput"] for r in serve_runs)
    offline_rate = statistics.median(offline_rates)
    pairs = [r["output_throughput"] / o for r, o in zip(serve_runs, offline_rates, strict=True)]
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "workload": f"{NUM_STREAMS} streams x {NEW_TOKENS} tokens",
        "served_output_tok_s": served_rate, "offline_output_tok_s": offline_rate,
        "served_of_offline_pairs": pairs, "served_of_offline": statistics.median(pairs),
        "served_ttft_p50_ms": statistics.median(1e3 * r["ttft"]["p50"] for r in serve_runs),
        "served_itl_p50_ms": statistics.median(1e3 * r["itl"]["p50"] for r in serve_runs),
        "served_runs": serve_runs, "offline_runs": offline_rates,
    }
    print(f"\n| side | output tok/s (median of {args.repeats}) |\n| --- | --- |")
    print(f"| served (bench serve -> kvpilot serve, {NUM_STREAMS} concurrent) | {served_rate:.1f} |")
    print(f"| offline (LLM.generate, same prompts) | {offline_rate:.1f} |")
    print(f"| served / offline, median of the pairs | {statistics.median(pairs):.1%} "
          f"({', '.join(f'{p:.0%}' for p in pairs)}) |")
    print(f"served TTFT P50 {result['served_ttft_p50_ms']:.0f} ms, ITL P50 {result['served_itl_p50_ms']:.1f} ms; "
          f"load average {result['load_average'][0]:.1f} on {os.cpu_count()} CPUs")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
