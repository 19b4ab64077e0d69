"""The `kvpilot` console script.

Each subcommand lives in its own module and is imported only when chosen, so `kvpilot operator`
runs in an image without torch and `kvpilot --help` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib import import_module
from typing import NoReturn

# subcommand -> (module, one-line help). The module has `add_arguments(parser)` and `run(args)`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("kvpilot.bench.cli", "Benchmarks: serve, throughput, autoscale, autotune."),
    "generate": ("kvpilot.runtime.generate_cli", "Generate completions offline for prompts."),
    "operator": ("kvpilot.operator.cli", "Run the InferenceService operator (kopf)."),
    "serve": ("kvpilot.runtime.server.cli", "Serve a model over an OpenAI-compatible HTTP API."),
}


class _Parser(argparse.ArgumentParser):
    """Bad flags fail with one line naming the flag, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that subcommand's module is imported for its flags (the
    others' take time that `kvpilot serve`'s start would wait for: the operator's pulls pydantic)."""
    parser = _Parser(prog="kvpilot", description="LLM serving for Kubernetes.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        if command is None or name == command:
            import_module(module).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # torch reads this once, at its first CPU allocation (so before it is imported): large tensors
    # get 2 MiB pages. The CPU engine streams every weight each decode step, and fewer TLB misses
    # make that stream quicker.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    run: Callable[[argparse.Namespace], int] = import_module(args._module).run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
