"""One server's run of `kvpilot bench autotune` (bench/autotune.py): a fresh `kvpilot serve` with a
plan's knobs and the KV budget, the workload sent to it (whole, or each phase alone when screening),
its preemption and swap counters sampled meanwhile, and for a tuned plan the operator's tuning step
run against it (bench/autotune_loop.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Knobs:
    """A configuration of the tuned knobs; a batch limit left None is the server's own (its flags')."""

    block_size: int
    preemption_mode: str
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    @property
    def name(self) -> str:
        extra = [f"{k}{v}" for k, v in (("s", self.max_num_seqs), ("t", self.max_num_batched_tokens)) if v is not None]
        return " ".join([f"b{self.block_size}", self.preemption_mode, *extra])

    def flags(self) -> list[str]:
        out = ["--block-size", str(self.block_size), "--preemption-mode", self.preemption_mode]
        if self.max_num_seqs is not None:
            out += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            out += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return out


@dataclass(frozen=True)
class RunPlan:
    config: str  # what the run measures: a static configuration's name, or "autotuner"
    knobs: Knobs
    tuned: bool
    repeat: int = 0  # of `--repeats`, from 0
    repeats: int = 1

    @property
    def name(self) -> str:
        return self.config if self.repeats == 1 else f"{self.config} #{self.repeat + 1}"

    @property
    def block_size(self) -> int:
        return self.knobs.block_size

    @property
    def preemption_mode(self) -> str:
        return self.knobs.preemption_mode


async def one_run(args: argparse.Namespace, plan: RunPlan, timed: list[Any], serve_flags: list[str], spec: Any,
                   progress: Any) -> dict[str, Any]:
    import aiohttp

    from kvpilot.operator.autotune import EngineLimits, PodEndpoint

    from .autotune_loop import LiveTuner
    from .loadgen import LoadConfig, run_load
    from .server_process import serve

    token = secrets.token_hex(16)
    flags_ = [*serve_flags, *plan.knobs.flags(), "--num-gpu-blocks-override", str(args.kv_tokens // plan.block_size),
              "--admin-token", token, "--disable-log-stats"]
    log_dir = args.output.parent / "autotune-logs" if args.output else Path(tempfile.gettempdir()) / "kvpilot-autotune-logs"
    async with serve(flags_, log_dir / f"{plan.name.replace(' ', '-')}.log") as base:
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(headers=headers) as session, \
                session.get(f"{base}/admin/config") as response:
            engine = await response.json()
            async with session.get(f"{base}/v1/models") as models:
                model = (await models.json())["data"][0]["id"]
        parsed = _parsed_serve_flags(serve_flags)
        limits = EngineLimits(swap_space_gib=parsed.swap_space, max_model_len=int(engine["max_model_len"]),
                              enable_chunked_prefill=parsed.enable_chunked_prefill)
        endpoint = PodEndpoint("bench-server", "127.0.0.1", int(base.rsplit(":", 1)[1]))
        config = LoadConfig(base, model, ignore_eos=True, seed=args.seed)
        counters = _CounterSampler(endpoint)
        stop = asyncio.Event()
        started_at = time.time()
        tuner = LiveTuner([endpoint], spec, limits, token, started_at) if plan.tuned else None
        side = [asyncio.create_task(counters.run(stop, started_at))]
        if tuner is not None:
            side.append(asyncio.create_task(tuner.run(stop)))
        try:
            if args.screen is None:
                load = await run_load(config, [t.request for t in timed], progress=progress,
                                      arrivals=[t.at for t in timed])
            else:  # each phase alone: the next starts once the server is idle again
                load = await _phases_alone(config, timed, progress)
        finally:
            stop.set()
            await asyncio.gather(*side)
    return {"plan": plan, "load": load, "counters": counters.points, "tuner": tuner.log if tuner else None,
            "num_gpu_blocks": engine["num_blocks"]}


async def _phases_alone(config: Any, timed: list[Any], progress: Any) -> Any:
    """The phases one after another, each sent once the one before was answered in full (its
    arrival times kept relative to its own start); the results in `timed`'s order, their send
    times moved back onto the workload's clock so that the report splits them by phase."""
    from .loadgen import LoadResult, run_load

    results: list[Any] = []
    started, began = time.time(), time.monotonic()
    for phase in sorted({t.phase for t in timed}):
        mine = [t for t in timed if t.phase == phase]
        offset = min(t.at for t in mine)
        load = await run_load(config, [t.request for t in mine], progress=progress,
                              arrivals=[t.at - offset for t in mine])
        results += [dataclasses.replace(r, sent_s=r.sent_s + offset) for r in load.results]
    return LoadResult(results, time.monotonic() - began, started)


def _parsed_serve_flags(serve_flags: list[str]) -> argparse.Namespace:
    from kvpilot.runtime.cli import build_parser

    return build_parser().parse_args(["serve", *serve_flags])


class _CounterSampler:
    """The server's preemption and swap counters over time (seconds from the load's start), read
    through the operator's own `/metrics` parser."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self.points: list[tuple[float, float, float]] = []  # (t, preemptions, swap bytes)

    async def run(self, stop: asyncio.Event, started_at: float) -> None:
        import aiohttp

        from kvpilot.operator.autotune.scrape import ScrapeError, fetch_sample

        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    sample = await fetch_sample(session, self.endpoint, 5.0)
                except ScrapeError:
                    pass
                else:
                    total = {key: sum(p.value for p in sample.counters[key].values())
                             for key in ("preemptions", "swap_bytes")}
                    self.points.append((sample.time - started_at, total["preemptions"], total["swap_bytes"]))
                if stop.is_set():
                    return
                with contextlib.suppress(TimeoutError):  # asyncio.timeout keeps a cancellation
                    async with asyncio.timeout(1.0):
                        await stop.wait()
