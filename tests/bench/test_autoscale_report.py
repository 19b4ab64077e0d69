"""The comparisons `kvpilot bench autoscale` prints: one family's frontier against another's at
the cost of each of the other's settings, and requests outside the SLO read at a cost between two
settings."""

from __future__ import annotations

import pytest

from kvpilot.bench.autoscale_report import Row, frontier_gap, outside_at, reach


def row(setting: str, cost: float, outside: int) -> Row:
    return Row(setting, "f", setting, "", 1_000_000, outside, 0, 100 * cost, 100.0, 0, 0)


MINE = [row("h0.7", 0.55, 900), row("h0.6", 0.65, 100), row("h0.5", 0.77, 5)]


def test_a_frontier_reaches_the_best_share_of_the_settings_it_can_afford() -> None:
    assert reach(MINE, 0.5) is None
    assert reach(MINE, 0.70) == pytest.approx(1 - 100 / 1e6)
    assert reach(MINE, 2.0) == pytest.approx(1 - 5 / 1e6)


def test_a_frontier_is_judged_at_each_of_the_others_costs_it_covers() -> None:
    above = [row("a", 0.66, 150), row("b", 0.9, 10), row("cheap", 0.45, 5000)]
    margin, at, cheaper = frontier_gap(MINE, above)
    assert at is not None and at.setting == "b" and margin == pytest.approx(5e-6)  # 5 outside against 10
    assert [r.setting for r in cheaper] == ["cheap"]
    margin, at, _ = frontier_gap(MINE, [row("c", 0.70, 50)])  # 50 outside at 70%: mine has 100 there
    assert at is not None and margin == pytest.approx(-50 / 1e6)


def test_requests_outside_are_read_log_linearly_between_two_settings() -> None:
    assert outside_at(MINE, 0.65) == pytest.approx(100)
    assert outside_at(MINE, 0.60) == pytest.approx((900 * 100) ** 0.5)  # halfway in cost, in log
    assert outside_at(MINE, 0.5) is None and outside_at(MINE, 0.8) is None
