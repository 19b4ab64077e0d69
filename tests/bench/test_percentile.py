"""One percentile for every benchmark table: numpy's linear interpolation, as vLLM's serving
benchmark reports it, and no other definition anywhere in bench/ or benchmarks/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvpilot.bench.percentile import percentile
from kvpilot.bench.summary import latency_stats

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # between the two middle values, not either of them
    ([float(v) for v in range(1, 101)], 99, 99.01),  # interpolated, not the 99th value
    ([float(v) for v in range(1, 101)], 90, 90.1),
    ([3.0, 1.0, 2.0], 0, 1.0),  # order of the input does not matter
    ([3.0, 1.0, 2.0], 100, 3.0),
    ([7.0], 99, 7.0),
])
def test_percentile_interpolates_between_ordered_values(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_nothing_to_take_a_percentile_of_and_a_q_out_of_range_are_errors() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"q must lie in \[0, 100\], not 101"):
        percentile([1.0], 101)


def test_bench_serve_reports_the_same_percentiles() -> None:
    stats = latency_stats([0.4, 0.1, 0.3, 0.2])
    assert stats is not None
    assert (stats["p50"], stats["p90"], stats["p99"]) == pytest.approx((0.25, 0.37, 0.397))


def test_no_benchmark_defines_a_percentile_of_its_own() -> None:
    own = []
    for path in [*(REPO / "bench").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]:
        if path == REPO / "bench" / "percentile.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            is_def = (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                      and node.name.strip("_") in {"percentile", "quantile"})
            calls_numpy = (isinstance(node, ast.Attribute) and node.attr in {"percentile", "quantile"}
                           and isinstance(node.value, ast.Name) and node.value.id in {"np", "numpy"})
            if is_def or calls_numpy:
                own.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert own == []
