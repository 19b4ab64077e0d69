"""argparse types the benchmarks share: bad values fail with one line naming the flag."""

from __future__ import annotations

import argparse
import math


def rate(text: str) -> float:
    if text.strip().lower() == "inf":
        return math.inf
    return positive(text)


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, not {text!r}")
    return value


def tokenizer_folder(text: str) -> str:
    from kvpilot.runtime.model_source import ModelSourceError, tokenizer_folder

    try:
        return str(tokenizer_folder(text))
    except ModelSourceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
