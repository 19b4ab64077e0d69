"""argparse types shared by the runtime's flags (`args.py`) and the benchmark CLI's
(`kvpilot.bench.flags`): a value is parsed, then held to a rule; a bad one fails with one line that
names the rule (argparse adds the flag). A live tunable's flag takes its rule from the tunables
contract, wherever the flag is spelled. No torch: the CLI builds its parsers before anything heavy
is imported."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from kvpilot.runtime.tunables import Tunable


def checked(parse: Callable[[str], float], ok: Callable[[float], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: parse the text, then require `ok(value)`; errors say `rule`."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule}, not {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, not {text!r}")
        return value
    return convert


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


positive_int = checked(int, lambda v: v > 0, "a positive integer")
non_negative_int = checked(int, lambda v: v >= 0, "a non-negative integer")
positive_float = checked(_finite, lambda v: v > 0, "a positive number")
non_negative_float = checked(_finite, lambda v: v >= 0, "a number >= 0")
fraction = checked(_finite, lambda v: 0 < v <= 1, "a number in (0, 1]")


def tunable(t: Tunable) -> Callable[[str], Any]:
    """The argparse type of a live tunable's flag: its kind, held to the contract's rule."""
    def valid(value: Any) -> bool:
        try:
            t.check(value)
        except ValueError:
            return False
        return True
    return checked(t.kind, valid, t.rule)
