"""The host side of a live block-size change, on the CPU at a full H200 cache's scale: where the
pause goes when nothing waits for a GPU.

One engine on the CPU (a dummy model of `--layers` layers, 32 as Llama-3-8B, so that per-tensor work
counts as there, but one KV head of 8 float16 dimensions, so the cache copies stay small)
with the block count of the Llama-3-8B run in bench_block_switch.py (`--num-blocks` blocks of 16,
56,488 by default) and a swap space of the same number of blocks as 4 GiB holds there
(`--swap-tokens`). `--running` sequences of `--tokens` tokens each (±10%) hold blocks handed out
from a shuffled free pool (a cache that has served for a while: no sequence's blocks are
consecutive), `--swapped` more sit in the swap space. Then the engine switches block sizes through
`update_config` along `--sizes`; this is done `--repeat` times, each time with the sequences made
anew (a merge right after the splits that the same blocks went through moves nothing), and each
switch's `relayout` report (plan_ms, copy_ms, swap_ms, rebuild_ms, pause_ms) is summarised by its
median and its minimum (on a loaded machine the least noisy estimate), and once more as the
pair's first switch in the process against the median of its repeats: a cost the first switch
pays and later ones do not (something made or loaded on first use) shows there. All twelve ordered
pairs of 8/16/32/64, from 16: `--sizes 8 32 16 64 8 64 32 64 16 32 8 16`. torch runs one thread: the figures are the host's work, and on a VM whose cores are shared
idle OpenMP threads turn milliseconds of copying into hundreds. copy_ms and swap_ms here copy a
tiny cache on the CPU; on a GPU the cache copies run on the device (bench_block_switch.py).

  python3 benchmarks/bench_relayout_cpu.py --output relayout_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.model_source import load_preset
from kvpilot.runtime.sched.sequence import SequenceStatus

FIELDS = ("plan_ms", "wait_ms", "copy_ms", "swap_ms", "rebuild_ms", "pause_ms")


def fill(llm: LLM, args: argparse.Namespace, rng: random.Random) -> None:
    """Running and swapped sequences with their KV in place, as if the engine had served them."""
    engine = llm.engine
    bm, sched = engine.block_manager, engine.scheduler
    # every free block handed out, then given back in random order: the pool a busy cache has
    holder = engine.add_request("holder", [0], SamplingParams(max_tokens=1)).seqs[0]
    sched.waiting.remove(holder)
    holder.block_table = bm.allocate(bm.num_free_blocks)
    rng.shuffle(holder.block_table)
    bm.free(holder)
    del engine.requests["holder"]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    for i in range(args.running + args.swapped):
        n = rng.randint(int(args.tokens * 0.9), int(args.tokens * 1.1))
        request = engine.add_request(f"r{i}", [rng.randrange(256) for _ in range(n)], params)
        seq = request.seqs[0]
        sched.waiting.remove(seq)
        seq.num_computed_tokens = n - 1  # the last token is the next step's input
        if i < args.running:
            bm.append(seq, n - 1)
            bm.register_computed(seq)
            seq.status = SequenceStatus.RUNNING
            sched.running.append(seq)
        else:
            count = -(-(n - 1) // bm.block_size)
            if not sched.swap_pool.can_allocate(count):
                raise SystemExit(f"--swapped {args.swapped} sequences do not fit the swap space")
            seq.swap_table = sched.swap_pool.allocate(count)
            seq.status = SequenceStatus.SWAPPED
            sched.swapped.append(seq)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-blocks", type=int, default=56488, help="cache blocks of 16 tokens")
    p.add_argument("--swap-tokens", type=int, default=32768,
                   help="swap space in tokens (4 GiB of Llama-3-8B KV in bf16: 32,768)")
    p.add_argument("--running", type=int, default=150)
    p.add_argument("--swapped", type=int, default=0)
    p.add_argument("--tokens", type=int, default=600, help="cached tokens per sequence (±10%%)")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 16], help="block sizes to switch to, in turn")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--output", type=Path, help="write the results here as JSON")
    args = p.parse_args()
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="relayout-bench-"))
    config = load_preset("tiny-llama") | {"num_hidden_layers": args.layers, "hidden_size": 16,
                                          "num_attention_heads": 2, "num_key_value_heads": 1}
    (folder / "config.json").write_text(json.dumps(config))
    bytes_per_token = 2 * args.layers * 8 * 2  # K and V x layers x one KV head of 8 dims x float16
    llm = LLM(str(folder), load_format="dummy", device="cpu", dtype="float16", block_size=16, max_model_len=1024,
              max_num_seqs=max(256, args.running), num_gpu_blocks_override=args.num_blocks,
              swap_space=args.swap_tokens * bytes_per_token / (1 << 30), enable_prefix_caching=args.prefix_caching)
    engine = llm.engine
    fill(llm, args, random.Random(0))
    rows: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(args.repeat):
        if repeat:
            for rid in list(engine.requests):
                engine.abort_request(rid)
            fill(llm, args, random.Random(repeat))
        for size in args.sizes:
            old = engine.block_manager.block_size
            if size == old:
                continue
            engine.update_config({"block_size": size})
            report = engine.last_relayout
            assert report is not None and not report.preempted, "the bench's sequences must all fit"
            rows.setdefault(f"{old}->{size}", []).append(report.as_dict())
    summary = {name: {f: statistics.median(r[f] for r in runs) for f in FIELDS}
               | {f"min_{f}": min(r[f] for r in runs) for f in FIELDS}
               | {"bytes_moved": statistics.median(r["bytes_moved"] for r in runs),
                  "num_running_kept": runs[0]["num_running_kept"]}
               for name, runs in rows.items()}
    first = {name: {f: runs[0][f] for f in FIELDS} | {f"repeated_{f}": statistics.median(r[f] for r in runs[1:])
                                                        for f in FIELDS if len(runs) > 1}
             for name, runs in rows.items()}
    print(f"{args.running} running ({args.tokens} tokens), {args.swapped} swapped, {args.num_blocks} blocks of 16; "
          f"median (min) of {args.repeat}, ms")
    print(f"{'switch':>8} " + " ".join(f"{f:>15}" for f in FIELDS))
    for name, s in summary.items():
        print(f"{name:>8} " + " ".join(f"{s[f]:7.2f} ({s[f'min_{f}']:5.2f})" for f in FIELDS))
    if args.repeat > 1:
        print("first switch of each pair in the process (median of its repeats), ms")
        print(f"{'switch':>8} " + " ".join(f"{f:>15}" for f in FIELDS))
        for name, s in first.items():
            print(f"{name:>8} " + " ".join(f"{s[f]:7.2f} ({s[f'repeated_{f}']:5.2f})" for f in FIELDS))
    if args.output:
        args.output.write_text(json.dumps({"args": vars(args) | {"output": str(args.output)}, "summary": summary,
                                           "first": first, "runs": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
