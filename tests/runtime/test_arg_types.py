"""The argparse types of the runtime's flags, which the benchmark CLI shares: one rule each, one
line naming it when a value breaks it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from kvpilot.bench import autotune, flags
from kvpilot.runtime import arg_types
from kvpilot.runtime.args import add_engine_arguments


@pytest.mark.parametrize(("kind", "text", "value"), [
    (arg_types.positive_int, "3", 3),
    (arg_types.non_negative_int, "0", 0),
    (arg_types.positive_float, "0.5", 0.5),
    (arg_types.non_negative_float, "0", 0.0),
    (arg_types.fraction, "1", 1.0),
    (flags.rate, "inf", float("inf")),
    (flags.percent, "100", 100.0),
    (flags.tolerance, "0", 0.0),
])
def test_a_value_within_the_rule_is_parsed(kind: Callable[[str], Any], text: str, value: float) -> None:
    assert kind(text) == value


@pytest.mark.parametrize(("kind", "text", "message"), [
    (arg_types.positive_int, "0", "must be a positive integer, not '0'"),
    (arg_types.positive_int, "1.5", "must be a positive integer, not '1.5'"),
    (arg_types.non_negative_int, "-1", "must be a non-negative integer, not '-1'"),
    (arg_types.positive_float, "inf", "must be a positive number, not 'inf'"),
    (arg_types.positive_float, "nan", "must be a positive number, not 'nan'"),
    (arg_types.non_negative_float, "-0.5", "must be a number >= 0, not '-0.5'"),
    (arg_types.fraction, "1.5", "must be a number in (0, 1], not '1.5'"),
    (flags.rate, "0", "must be a positive number, not '0'"),
    (flags.percent, "101", "must be a number in (0, 100], not '101'"),
    (flags.tolerance, "1", "must be a number in [0, 1), not '1'"),
])
def test_a_value_outside_the_rule_is_refused_naming_it(kind: Callable[[str], Any], text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        kind(text)
    assert str(refused.value) == message


def _refusal(parser: argparse.ArgumentParser, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    return capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[1]


@pytest.mark.parametrize(("engine_flag", "bench_flag", "text", "message"), [
    ("--max-num-seqs", "--max-num-seqs", "0", "must be an integer from 1 to 65536, not '0'"),
    ("--max-num-batched-tokens", "--max-num-batched-tokens", "2097152",
     "must be an integer from 1 to 1048576, not '2097152'"),
    ("--block-size", "--block-sizes", "12", "must be one of 8, 16, 32, 64, not '12'"),
])
def test_the_benchmarks_and_the_engine_flags_refuse_alike(
        engine_flag: str, bench_flag: str, text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A live tunable's flag in `kvpilot serve` and in `kvpilot bench autotune` is held to the
    tunables contract's rule and refused in the same words."""
    engine = argparse.ArgumentParser(prog="kvpilot serve")
    add_engine_arguments(engine)
    bench = argparse.ArgumentParser(prog="kvpilot bench autotune")
    autotune.add_arguments(bench)
    assert _refusal(engine, [engine_flag, text], capsys) == f"argument {engine_flag}: {message}"
    assert _refusal(bench, [bench_flag, text], capsys) == f"argument {bench_flag}: {message}"


def test_the_benchmarks_number_types_are_the_engines() -> None:
    assert flags.positive_int is arg_types.positive_int and flags.positive_float is arg_types.positive_float
    assert flags.tunable is arg_types.tunable
