"""How long `kvpilot serve`'s event loop stalls while it handles 64 concurrent long-prompt requests.

The server runs in this process (uvicorn in a thread, the engine core in its own process, the
embedded SmolLM2); a ticker task on the server's own event loop sleeps 1 ms at a time and records
how late each wake-up is: the worst lateness is the longest the loop could not serve anyone (a
health probe, a token to stream). Two scenarios, each 64 completions sent at once:

* `beyond`: prompts of --beyond-chars characters, far past the context (the server refuses them);
* `within`: prompts of --within-chars characters that fit the context, one token generated each.

Prints, per scenario, the worst and 99th-percentile stall, the wall time and the status codes,
and writes them as JSON with --out DIR.
Usage: PYTHONSAFEPATH=1 .venv/bin/python benchmarks/bench_event_loop.py [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from kvpilot.runtime.args import EngineArgs
from kvpilot.runtime.server.app import ServerConfig, make_server

NUM_REQUESTS = 64
WORDS = ["river", "stone", "light", "market", "orbit", "garden", "signal", "winter", "copper", "thread"]


def prompt(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:chars]


class Ticker:
    """Wakes every `period` s on the loop it runs on and records how late each wake-up was."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lateness: list[float] = []
        self.running = True

    async def run(self) -> None:
        while self.running:
            before = time.perf_counter()
            await asyncio.sleep(self.period)
            self.lateness.append(time.perf_counter() - before - self.period)


async def send_all(base_url: str, prompts: list[str], max_tokens: int) -> Counter[int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json={
            "prompt": p, "max_tokens": max_tokens, "temperature": 0}) for p in prompts))
    return Counter(r.status_code for r in replies)


def scenario(server: Any, base_url: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    ticker = Ticker()
    ticking = asyncio.run_coroutine_threadsafe(ticker.run(), server._loop)
    time.sleep(0.2)  # the ticker's idle baseline
    started = time.perf_counter()
    statuses = asyncio.run(send_all(base_url, prompts, max_tokens))
    wall = time.perf_counter() - started
    ticker.running = False
    ticking.result(timeout=10)
    late = sorted(ticker.lateness)
    return {"worst_stall_ms": 1000 * late[-1], "p99_stall_ms": 1000 * late[int(0.99 * (len(late) - 1))],
            "median_stall_ms": 1000 * statistics.median(late), "wall_s": wall,
            "statuses": {str(k): v for k, v in sorted(statuses.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--beyond-chars", type=int, default=100_000, help="characters per prompt past the context")
    parser.add_argument("--within-chars", type=int, default=1_600, help="characters per prompt within the context")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    parser.add_argument("--commit", default=os.environ.get("KVPILOT_BENCH_COMMIT"),
                        help="the commit measured, for the record (default: $KVPILOT_BENCH_COMMIT, which "
                             "before_after.sh sets, else this checkout's HEAD)")
    args = parser.parse_args()

    engine_args = EngineArgs(max_model_len=args.max_model_len, max_num_seqs=64, max_num_batched_tokens=8192)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    server = make_server(engine_args.create_engine_config(), ServerConfig(port=port, disable_log_stats=True),
                         log_level="warning", engine_args=engine_args)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.state.started:
        time.sleep(0.1)
    base_url = f"http://127.0.0.1:{port}"
    results = {
        "beyond": scenario(server, base_url, [prompt(args.beyond_chars, i) for i in range(NUM_REQUESTS)], 1),
        "within": scenario(server, base_url, [prompt(args.within_chars, i) for i in range(NUM_REQUESTS)], 1),
    }
    server.should_exit = True
    thread.join(timeout=60)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    meta = {"commit": commit, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_average": os.getloadavg(), "python": sys.version.split()[0], "args": vars(args) | {"out": None, "commit": None}}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_event_loop.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"commit {commit}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'scenario':<8} {'worst stall ms':>15} {'p99 stall ms':>13} {'wall s':>8}  statuses")
    for name, r in results.items():
        print(f"{name:<8} {r['worst_stall_ms']:>15.1f} {r['p99_stall_ms']:>13.1f} {r['wall_s']:>8.2f}  {r['statuses']}")


if __name__ == "__main__":
    main()
