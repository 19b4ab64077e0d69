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
from kvpilot.runtime.tunables import MAX_NUM_SEQS


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


def test_the_benchmarks_and_the_engine_flags_refuse_alike(capsys: pytest.CaptureFixture[str]) -> None:
    """A live tunable is held to the tunables contract's rule by `kvpilot serve` and `kvpilot bench
    autotune` (whose grid gives the servers its values) in the same words."""
    refusals = []
    for prog, add in (("kvpilot serve", add_engine_arguments), ("kvpilot bench autotune", autotune.add_arguments)):
        parser = argparse.ArgumentParser(prog=prog)
        add(parser)
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-num-seqs", "0"])
        refusals.append(capsys.readouterr().err.strip().splitlines()[-1].removeprefix(f"{prog}: error: "))
    assert refusals == [f"argument --max-num-seqs: must be an integer from 1 to {MAX_NUM_SEQS.maximum}, not '0'"] * 2
    assert flags.positive_int is arg_types.positive_int and flags.positive_float is arg_types.positive_float
