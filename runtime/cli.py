"""The `kvpilot` console script.

Each subcommand lives in its own module and is imported only when chosen, so `kvpilot operator`
runs in an image without torch and `kvpilot --help` is instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import import_module

# subcommand -> (module, one-line help). The module has `add_arguments(parser)` and `run(args)`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpilot", description="LLM serving for Kubernetes.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        import_module(module).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    run: Callable[[argparse.Namespace], int] = import_module(args._module).run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
