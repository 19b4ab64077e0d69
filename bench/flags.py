"""argparse types the benchmarks share: bad values fail with one line naming the flag. The number
types are the runtime's own (`kvpilot.runtime.arg_types`), so `kvpilot bench` and `kvpilot serve`
hold a value to the same rule and say so in the same words; a live tunable's flag (`tunable(...)`) is
held to the tunables contract's rule, as `kvpilot serve` holds it."""

from __future__ import annotations

import argparse
import math

from kvpilot.runtime.arg_types import (
    checked,
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    tunable,
)

__all__ = ["fraction", "non_negative_float", "non_negative_int", "percent", "positive_float", "positive_int", "rate", "tolerance",
           "tokenizer_folder", "tunable"]

percent = checked(float, lambda v: 0 < v <= 100, "a number in (0, 100]")
tolerance = checked(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def rate(text: str) -> float:
    """A request rate: a positive number, or "inf" (every request at once)."""
    if text.strip().lower() == "inf":
        return math.inf
    return float(positive_float(text))


def tokenizer_folder(text: str) -> str:
    from kvpilot.runtime.model_source import ModelSourceError, tokenizer_folder

    try:
        return str(tokenizer_folder(text))
    except ModelSourceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
