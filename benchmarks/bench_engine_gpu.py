"""Whole-engine GPU throughput: decode of a Llama-3-8B-shaped model (dummy bf16 weights) at several
batch sizes, the median decode step against its bandwidth floor (the weights a step reads whole, all
but the input embedding, and the KV, read once per step, at the copy rate measured in the same
run). Correctness on CUDA is tests/runtime/test_gpu_engine.py.

Each batch size runs with decode CUDA graphs and then without them in the same engine (forward_ms:
the device span of the forward pass; the rest of a step is the host's scheduling and sampling), and
with decode graphs both with async scheduling (the host prepares step N+1 while the device runs
step N: engine.py) and without, switched in the same engine. A step's time is the span between two
`step()` returns, with no synchronisation added, so under async scheduling it is the pipeline's
period.

Each row also gives the GPU's SM clock (median, lowest), median power draw and the share of
samples slowed by the power cap over its counted steps (sampled by `nvidia-smi` every 100 ms; null
where it is not installed): at batch 256 an H200 runs into its power limit, and its clock, not the
kernels, then sets the GEMMs' time (`bench_step_power.py` shows which part of the step draws it).

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_engine_gpu.py [--batches 1 32 128 256] [--out FILE]
                 [--enforce-eager]  (an engine without graphs: eager rows only)
                 [--async-scheduling both|on|off]  (default both)
                 [--prompt-len 512] [--new-tokens 128]  (a step's context: the prompt plus half the new tokens)
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.executor.inputs import StepInputs
from kvpilot.runtime.executor.model_runner import ModelRunner

PROMPT_LEN, NEW_TOKENS = 512, 128


def copy_rate() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy: the traffic ceiling, so a
    step's floor is the bytes it must read over this rate."""
    import triton

    src = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 4 * (1 << 29) / (ms * 1e-3)


class ClockLog:
    """`nvidia-smi` sampling the SM clock, power draw and throttle reasons every 100 ms into a file,
    for summaries over a window of wall-clock time (`window`)."""

    POWER_CAP = 0x4  # clocks_throttle_reasons.active: the software power cap

    def __init__(self) -> None:
        self._file = tempfile.NamedTemporaryFile("w+", suffix=".csv")
        self._proc = None
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", "100"], stdout=self._file, stderr=subprocess.DEVNULL)

    def window(self, begin: float, end: float) -> dict[str, float | None]:
        """Over the samples between two `time.time()` readings: the median and lowest SM clock
        (MHz), the median power (W), and the share of samples the power cap was slowing the clock."""
        clocks, watts, capped = [], [], []
        if self._proc is not None:
            self._file.flush()
            for line in Path(self._file.name).read_text().splitlines():
                try:
                    stamp, clock, power, reasons = (part.strip() for part in line.split(","))
                    at = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    if begin <= at <= end:
                        clocks.append(float(clock))
                        watts.append(float(power))
                        capped.append(bool(int(reasons, 16) & self.POWER_CAP))
                except ValueError:  # a partly written line
                    continue
        return {"sm_clock_mhz": statistics.median(clocks) if clocks else None,
                "sm_clock_min_mhz": min(clocks) if clocks else None,
                "power_w": statistics.median(watts) if watts else None,
                "power_capped": sum(capped) / len(capped) if capped else None}

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        self._file.close()


def throughput(batches: list[int], rate: float, enforce_eager: bool = False,
               async_modes: tuple[bool, ...] = (True, False)) -> list[dict[str, float | str | bool]]:
    """Each batch size runs in the same engine with the decode graphs, under each of `async_modes`,
    then without graphs (the runner's graphs set aside), so every mode sees the same host;
    --enforce-eager runs only the eager rows."""
    started = time.perf_counter()
    llm = LLM("llama-3-8b", load_format="dummy", device="cuda", max_model_len=PROMPT_LEN + NEW_TOKENS + 16,
              max_num_seqs=max(batches), max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
              enforce_eager=enforce_eager)
    print(json.dumps({"engine_start_s": time.perf_counter() - started, "enforce_eager": enforce_eager}), flush=True)
    rng = random.Random(0)
    llm.generate([{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(PROMPT_LEN)]}], SamplingParams(max_tokens=4))
    runner = llm.engine.runner
    weight_bytes = runner.model.streamed_weight_bytes()
    kv_per_token = runner.bytes_per_block // llm.engine.config.cache.block_size
    graphs = runner.graphs
    forward_ms = timed_forward(runner)
    clock = ClockLog()
    rows = []
    for batch in batches:
        # one decode step reads every weight but the input embedding's unused rows and, on average,
        # half the generated context's KV once
        floor = (weight_bytes + batch * (PROMPT_LEN + NEW_TOKENS // 2) * kv_per_token) / rate
        runs = [("graphs", a) for a in async_modes] if graphs is not None else []
        runs.append(("eager", async_modes[0]))
        for mode, overlap in runs:
            runner.graphs = graphs if mode == "graphs" else None
            llm.engine.async_scheduling = overlap  # between steps, with nothing in flight
            prompts = [[rng.randrange(1000, 100000) for _ in range(PROMPT_LEN)] for _ in range(batch)]
            row = decode_steps(llm, prompts, forward_ms, f"{mode}-{overlap}-{batch}", clock)
            rows.append({"batch": batch, "mode": mode, "async_scheduling": overlap, **row, "floor_ms": floor * 1e3,
                         "of_floor": floor * 1e3 / row["decode_step_ms"]})
            print(json.dumps(rows[-1]), flush=True)
    runner.graphs = graphs
    clock.close()
    return rows


Span = tuple[torch.cuda.Event, torch.cuda.Event]


def timed_forward(runner: ModelRunner) -> list[Span]:
    """Wrap the runner's forward pass (`_run`) so each call appends a pair of CUDA events around it
    (its device span, from its first launch to its last, host gaps included), read only after the
    run: waiting for them here would serialise the host with the device."""
    spans: list[Span] = []
    inner = runner._run

    def run(inputs: StepInputs) -> tuple[torch.Tensor | None, object]:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = inner(inputs)
        end.record()
        spans.append((begin, end))
        return out

    runner._run = run  # type: ignore[method-assign]
    return spans


def decode_steps(llm: LLM, prompts: list[list[int]], forward_spans: list[Span], tag: str,
                 clock: ClockLog) -> dict[str, float | None]:
    """Run the prompts to NEW_TOKENS tokens each; output tok/s over the whole run, and the median
    step time (between two `step()` returns) and forward time of the steps that decode the whole
    batch."""
    engine, batch = llm.engine, len(prompts)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    steps: list[float] = []
    kept: list[Span] = []
    counted: list[float] = []  # wall-clock times of the counted steps' ends
    torch.cuda.synchronize()
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        forward_spans.clear()
        engine.step()
        now = time.perf_counter()
        stats = engine.last_step
        # a full-batch decode: delivered by this call (async: the step before) and queued by it
        if (stats is not None and stats.num_prompt_tokens == 0 and stats.num_generation_tokens == batch
                and stats.num_batched_tokens == batch):
            steps.append(now - last)
            kept.extend(forward_spans)
            counted.append(time.time())
        last = now
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    step = statistics.median(steps)
    return {"output_tok_s": batch * NEW_TOKENS / elapsed, "decode_step_ms": step * 1e3,
            "forward_ms": statistics.median(b.elapsed_time(e) for b, e in kept), "decode_tok_s": batch / step,
            **clock.window(counted[0] - step, counted[-1])}


def main() -> None:
    global PROMPT_LEN, NEW_TOKENS
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--async-scheduling", choices=("both", "on", "off"), default="both",
                        help="decode-graph rows with async scheduling, without, or both (switched in one engine)")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    args = parser.parse_args()
    PROMPT_LEN, NEW_TOKENS = args.prompt_len, args.new_tokens
    async_modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.async_scheduling]
    rate = copy_rate()
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_TBps": rate / 1e12,
            "cuda_graphs": not args.enforce_eager, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS}
    print(json.dumps(head), flush=True)
    rows = throughput(args.batches, rate, args.enforce_eager, async_modes)
    if args.out:
        args.out.write_text(json.dumps({**head, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
