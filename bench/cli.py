"""`kvpilot bench BENCHMARK`: each benchmark lives in its own module, imported only when chosen
(`bench serve` needs no torch; `bench throughput` loads the engine)."""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

# benchmark -> (module, one-line help). The module has `add_arguments(parser)` and `run(args)`;
# add_arguments imports nothing heavy, since `kvpilot --help` builds every parser.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": ("kvpilot.bench.serve", "Load a running OpenAI-compatible server; latency, throughput, goodput."),
    "throughput": ("kvpilot.bench.throughput", "Offline throughput of LLM.generate on a model or preset."),
    "autoscale": ("kvpilot.bench.autoscale", "Simulate autoscaling policies on a measured capacity curve."),
    "autotune": ("kvpilot.bench.autotune", "Static engine configs against the live autotuner on a phased workload."),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True,
                                       parser_class=type(parser))
    for name, (module, help_text) in BENCHMARKS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_bench_module=module, _bench_missing=None)
        try:
            import_module(module).add_arguments(sub)
        except ImportError as e:  # an image without the bench extra still parses every other command
            sub.set_defaults(_bench_missing=str(e))


def run(args: argparse.Namespace) -> int:
    if args._bench_missing is not None:
        print(f"kvpilot bench {args.benchmark}: error: {args._bench_missing}; install kvpilot[bench]",
              file=sys.stderr)
        return 2
    result: int = import_module(args._bench_module).run(args)
    return result
