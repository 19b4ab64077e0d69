"""Live block-size changes under load: the decode pause of each switch, whether anything was
recomputed, TTFT/ITL percentiles against the same run without switches, and greedy equality.

One engine (a dummy-weight preset, by default the Llama-3-8B shape in bf16 with the full cache)
serves `--requests` prompts of `--prompt-len` random tokens, `--output-len` greedy tokens each,
arriving at `--rate` per second; the run is done twice with the same arrivals: without switches,
then with `POST /admin/config`'s engine call `update_config({"block_size": ...})` at each of
`--switch-at` seconds (sizes from `--switch-to`; each must fall inside the arrival window, so that
it happens under load). Per switch it reports the engine's relayout pause and where it went
(plan_ms, copy_ms: the device copies, swap_ms, rebuild_ms: docs/architecture.md), the wall gap
between the decode steps around it, the bytes moved and the requests recomputed (`preempted`, and
scheduler preemptions during the step after).

GPU (one H200):
  PYTHONSAFEPATH=1 python3 benchmarks/bench_block_switch.py --output block_switch.json
CPU smoke (a tiny model, seconds):
  python3 benchmarks/bench_block_switch.py --preset tiny-llama --device cpu --requests 12 --rate 40 \\
      --prompt-len 24 --output-len 24 --switch-at 0.05 0.1 0.15 --max-num-seqs 8 --output out.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from kvpilot.bench.percentile import percentile
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.tunables import BLOCK_SIZES, PREEMPTION_MODES


def run(args: argparse.Namespace, llm: LLM, prompts: list[list[int]], switches: list[tuple[float, int]]) -> dict[str, Any]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    interval = 1.0 / args.rate
    start = time.perf_counter()
    arrivals = [start + i * interval for i in range(len(prompts))]
    token_times: dict[str, list[float]] = {}
    outputs: dict[str, list[int]] = {}
    pending = list(switches)
    switch_rows: list[dict[str, Any]] = []
    last_step_end = start
    next_request = 0
    while next_request < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while next_request < len(prompts) and arrivals[next_request] <= now:
            rid = f"req-{next_request}"
            engine.add_request(rid, prompts[next_request], params, arrival_time=arrivals[next_request])
            token_times[rid] = [arrivals[next_request]]
            next_request += 1
        if pending and now - start >= pending[0][0]:
            at, size = pending.pop(0)
            preemptions = engine.scheduler.num_preemptions
            engine.update_config({"block_size": size})
            report = engine.last_relayout
            outs = engine.step()  # the first step after: its end minus the last one's is the decode gap
            end = time.perf_counter()
            _record(outs, end, token_times, outputs)
            row: dict[str, Any] = {"at_s": round(now - start, 3)}
            if report is not None:
                row.update(report.as_dict())
            row.update(decode_gap_ms=(end - last_step_end) * 1e3,
                       preemptions_around=engine.scheduler.num_preemptions - preemptions)
            switch_rows.append(row)
            last_step_end = end
            continue
        outs = engine.step()
        if engine.last_step is None and next_request < len(prompts):
            time.sleep(max(0.0, min(arrivals[next_request] - time.perf_counter(), 0.01)))
        last_step_end = time.perf_counter()
        _record(outs, last_step_end, token_times, outputs)
    elapsed = time.perf_counter() - start
    ttft = [(t[1] - t[0]) * 1e3 for t in token_times.values() if len(t) > 1]
    itl = [(b - a) * 1e3 for t in token_times.values() for a, b in zip(t[1:], t[2:], strict=False)]
    return {"elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
            "ttft_ms": {q: percentile(ttft, q) if ttft else None for q in (50, 90, 99)},
            "itl_ms": {q: percentile(itl, q) if itl else None for q in (50, 90, 99)},
            "preemptions": engine.scheduler.num_preemptions, "switches": switch_rows, "outputs": outputs}


def _record(outs: list, when: float, token_times: dict[str, list[float]], outputs: dict[str, list[int]]) -> None:
    for out in outs:
        times = token_times[out.request_id]
        ids = out.outputs[0].token_ids
        times.extend([when] * (len(ids) - (len(times) - 1)))  # tokens this step added
        if out.finished:
            outputs[out.request_id] = ids


def _first_difference(x: list[int], y: list[int]) -> int:
    return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))


def _differing(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, Any]:
    """How many requests' greedy outputs differ between two runs, and the median position of the
    first differing token among them."""
    at = sorted(_first_difference(a[r], b.get(r, [])) for r in a if a[r] != b.get(r))
    return {"requests": len(at), "of": len(a), "median_first_difference": at[len(at) // 2] if at else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3-8b", help="a dummy-weight preset (runtime/presets)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=16.0, help="arrivals per second")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16, choices=BLOCK_SIZES)
    p.add_argument("--switch-at", type=float, nargs="+", default=[5.0, 10.0, 15.0],
                   help="seconds into the run, each before the run ends")
    p.add_argument("--switch-to", type=int, nargs="+", default=[8, 32, 16], choices=BLOCK_SIZES, help="a block size per --switch-at")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-gpu-blocks", type=int, help="cache budget in blocks of --block-size (default: the full cache)")
    p.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES)
    p.add_argument("--control", action="store_true",
                   help="run the unswitched baseline twice too: how many greedy outputs differ between two "
                        "runs of one configuration (bf16 results depend on the batch each token ran in)")
    p.add_argument("--output", type=Path, help="write the results here as JSON")
    args = p.parse_args()
    if len(args.switch_at) != len(args.switch_to):
        p.error("--switch-at and --switch-to need one entry each per switch")
    last = (args.requests - 1) / args.rate
    if any(not 0 <= at <= last for at in args.switch_at):
        p.error(f"--switch-at: every switch must come before the last arrival ({args.requests} requests at "
                f"{args.rate}/s: {last:.2f} s), or it may not happen under load")
    rng = random.Random(0)
    llm = LLM(args.preset, load_format="dummy", device=args.device, dtype=args.dtype,
              max_model_len=args.prompt_len + args.output_len + 16, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_gpu_blocks_override=args.num_gpu_blocks, preemption_mode=args.preemption_mode)
    vocab = llm.engine.runner.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))  # warm-up
    baseline = run(args, llm, prompts, [])
    switched = run(args, llm, prompts, list(zip(args.switch_at, args.switch_to, strict=True)))
    llm.engine.update_config({"block_size": args.block_size})
    base_out, switched_out = baseline.pop("outputs"), switched.pop("outputs")
    equal = base_out == switched_out
    differing = _differing(base_out, switched_out)
    control = None
    if args.control:
        control = _differing(base_out, run(args, llm, prompts, []).pop("outputs"))
    result = {"preset": args.preset, "device": args.device, "num_blocks": llm.engine.block_manager.num_blocks,
              "requests": args.requests, "rate": args.rate, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "greedy_equal": equal, "differing": differing,
              "differing_unswitched_rerun": control, "baseline": baseline, "switched": switched,
              "recomputed": sum(len(s.get("preempted", [])) + len(s.get("swapped_recomputed", []))
                                + s["preemptions_around"] for s in switched["switches"])}
    print(f"{'switch':>10} {'pause ms':>9} {'plan':>6} {'wait':>6} {'copy':>6} {'swap':>6} {'rebuild':>7} "
          f"{'gap ms':>8} {'MiB moved':>10} {'kept':>5} {'recomputed':>10}")
    for s in switched["switches"]:
        print(f"{s.get('old_block_size')}->{s.get('new_block_size'):<6} {s.get('pause_ms', 0):9.1f} "
              + " ".join(f"{s.get(f, 0):{w}.1f}" for f, w in (("plan_ms", 6), ("wait_ms", 6), ("copy_ms", 6),
                                                              ("swap_ms", 6), ("rebuild_ms", 7)))
              + f" {s['decode_gap_ms']:8.1f} {s.get('bytes_moved', 0) / (1 << 20):10.1f} "
              f"{s.get('num_running_kept', 0):5d} {len(s.get('preempted', [])) + s['preemptions_around']:10d}")
    if len(switched["switches"]) < len(args.switch_at):
        print(f"only {len(switched['switches'])} of {len(args.switch_at)} switches happened")
    for name in ("baseline", "switched"):
        r = result[name]
        print(f"{name:>9}: TTFT p50/p99 {r['ttft_ms'][50]:.1f}/{r['ttft_ms'][99]:.1f} ms, "
              f"ITL p50/p99 {r['itl_ms'][50]:.1f}/{r['itl_ms'][99]:.1f} ms, {r['requests_per_s']:.2f} req/s")
    print(f"greedy outputs equal to the unswitched run: {equal} ({differing['requests']} of {differing['of']} "
          f"differ, the median from token {differing['median_first_difference']})")
    if control is not None:
        print(f"two unswitched runs: {control['requests']} of {control['of']} differ, "
              f"the median from token {control['median_first_difference']}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
