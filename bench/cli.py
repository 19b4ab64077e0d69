"""`kvpilot bench BENCHMARK`: each benchmark lives in its own module, imported only when chosen
(`bench serve` needs no torch; `bench throughput` loads the engine; `kvpilot --help` and
`kvpilot operator` must not pay for any of them, nor need their packages)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib import import_module
from typing import Any

# benchmark -> (module, one-line help). The module has `add_arguments(parser)` and `run(args)`.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": ("kvpilot.bench.serve", "Load a running OpenAI-compatible server; latency, throughput, goodput."),
    "throughput": ("kvpilot.bench.throughput", "Offline throughput of LLM.generate on a model or preset."),
    "autoscale": ("kvpilot.bench.autoscale", "Simulate autoscaling policies on a measured capacity curve."),
    "autotune": ("kvpilot.bench.autotune", "Static engine configs against the live autotuner on a phased workload."),
    "startup": ("kvpilot.bench.startup", "kvpilot serve from process start to /ready, phase by phase, page cache warm and cold."),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True,
                                       parser_class=_lazy_parser_class(type(parser)))
    for name, (module, help_text) in BENCHMARKS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_bench_module=module)
        sub.module = module  # type: ignore[attr-defined]


def run(args: argparse.Namespace) -> int:
    result: int = import_module(args._bench_module).run(args)
    return result


def _lazy_parser_class(base: type[argparse.ArgumentParser]) -> type[argparse.ArgumentParser]:
    """A parser that adds its benchmark's flags the first time it parses or shows help."""

    class LazyParser(base):  # type: ignore[valid-type,misc]
        module: str | None = None

        def _populate(self) -> None:
            module, self.module = self.module, None
            if module is None:
                return
            try:
                import_module(module).add_arguments(self)
            except ImportError as e:  # an image without the bench extra
                self.exit(2, f"{self.prog}: error: {e}; install kvpilot[bench]\n")

        def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
            self._populate()
            return super().parse_known_args(args, namespace)

        def format_help(self) -> str:
            self._populate()
            return str(super().format_help())

    return LazyParser
