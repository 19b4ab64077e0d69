"""`kvpilot serve`'s start-up for two trees, alternating, so that both see the same machine:

    python benchmarks/startup_before_after.py --before OLD --after NEW --rounds 5 [-- SERVE FLAGS]

OLD and NEW are folders that hold a `kvpilot` folder of links to a tree's packages (as
benchmarks/run_on_gpu.sh makes them); each server runs with PYTHONPATH set to one of them. Each
start is `kvpilot bench startup`'s (bench/startup.py): process start to /ready 200, the CPU seconds
the server's processes used, one request. Prints each start and the medians; `--output` keeps all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from kvpilot.bench.startup import start_once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default=None)
    parser.add_argument("serve_flags", nargs="*")
    args = parser.parse_args()
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for path in trees.values():  # one unmeasured start each: the embedded model converted once
        os.environ["PYTHONPATH"] = path
        start_once(args.serve_flags, "auto", 900, 0)
    for i in range(args.rounds):
        for name, path in trees.items():
            os.environ["PYTHONPATH"] = path
            load = os.getloadavg()[0]
            one = {**start_once(args.serve_flags, "auto", 900, 0), "load": load}
            runs[name].append(one)
            print(f"{name} {i}: ready {one['ready_wall_s']:.2f} s, {one['cpu_s']:.2f} CPU s, "
                  f"first request {one['first_request_s']:.2f} s, load {load:.1f}", flush=True)
    for name, done in runs.items():
        print(f"{name}: median ready {statistics.median(r['ready_wall_s'] for r in done):.2f} s, "
              f"{statistics.median(r['cpu_s'] for r in done):.2f} CPU s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
