"""The host side of a live block-size change, on the CPU at a full H200 cache's scale: where the
pause goes when nothing waits for a GPU.

One engine on the CPU (the `tiny-llama` dummy preset: 2 layers, so the cache copies stay small)
with the block count of the Llama-3-8B run in bench_block_switch.py (`--num-blocks` blocks of 16,
56,488 by default) and a swap space of the same number of blocks as 4 GiB holds there
(`--swap-tokens`). `--running` sequences of `--tokens` tokens each (±10%) hold blocks handed out
from a shuffled free pool (a cache that has served for a while: no sequence's blocks are
consecutive), `--swapped` more sit in the swap space. Then the engine switches block sizes through
`update_config` along `--sizes`, `--repeat` times, and each switch's `relayout` report
(plan_ms, copy_ms, swap_ms, rebuild_ms, pause_ms) is summarised by its median.

  python3 benchmarks/bench_relayout_cpu.py --output relayout_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import OrderedDict
from pathlib import Path
from typing import Any

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.engine.sequence import SequenceStatus

FIELDS = ("plan_ms", "wait_ms", "copy_ms", "swap_ms", "rebuild_ms", "pause_ms")


def fill(llm: LLM, args: argparse.Namespace, rng: random.Random) -> None:
    """Running and swapped sequences with their KV in place, as if the engine had served them."""
    engine = llm.engine
    bm, sched = engine.block_manager, engine.scheduler
    free = list(bm.free_block_ids)
    rng.shuffle(free)
    bm.free_block_ids = OrderedDict.fromkeys(free)
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
    p.add_argument("--output", type=Path, help="write the results here as JSON")
    args = p.parse_args()
    bytes_per_token = 2 * 2 * 2 * 16 * 4  # tiny-llama: K and V x 2 layers x 2 KV heads x head dim 16 x fp32
    llm = LLM("tiny-llama", load_format="dummy", device="cpu", block_size=16, max_model_len=1024,
              max_num_seqs=max(256, args.running), num_gpu_blocks_override=args.num_blocks,
              swap_space=args.swap_tokens * bytes_per_token / (1 << 30), enable_prefix_caching=args.prefix_caching)
    fill(llm, args, random.Random(0))
    engine = llm.engine
    rows: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeat):
        for size in args.sizes:
            old = engine.block_manager.block_size
            if size == old:
                continue
            engine.update_config({"block_size": size})
            report = engine.last_relayout
            assert report is not None and not report.preempted, "the bench's sequences must all fit"
            rows.setdefault(f"{old}->{size}", []).append(report.as_dict())
    summary = {name: {f: statistics.median(r[f] for r in runs) for f in FIELDS}
               | {"bytes_moved": runs[0]["bytes_moved"], "num_running_kept": runs[0]["num_running_kept"]}
               for name, runs in rows.items()}
    print(f"{args.running} running ({args.tokens} tokens), {args.swapped} swapped, {args.num_blocks} blocks of 16; "
          f"medians of {args.repeat}")
    print(f"{'switch':>8} " + " ".join(f"{f:>10}" for f in FIELDS))
    for name, s in summary.items():
        print(f"{name:>8} " + " ".join(f"{s[f]:10.2f}" for f in FIELDS))
    if args.output:
        args.output.write_text(json.dumps({"args": vars(args) | {"output": str(args.output)}, "summary": summary,
                                           "runs": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
