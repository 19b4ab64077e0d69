"""The simulator's inputs: capacity curves in both forms `kvpilot bench serve` and people write,
the latency draws through three percentiles, and arrival traces from files or the built-in day."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpilot.bench.arrival_trace import TraceError, day_trace, load_trace
from kvpilot.bench.capacity_curve import CurveError, load_curve, parse_curve, sample, share_within

EXAMPLE = Path(__file__).parent / "data" / "example-capacity-curve.json"


def flat(rate: float, served: float | None = None, ttft: tuple[float, float, float] = (50, 80, 120),
         **extra: Any) -> dict[str, Any]:
    point = {"request_rate": rate, "request_throughput": rate if served is None else served}
    for kind, values in (("ttft", ttft), ("itl", (10, 12, 15)), ("e2e", (1000, 1200, 1500))):
        point |= {f"{kind}_{p}_ms": v for p, v in zip(("p50", "p90", "p99"), values, strict=True)}
    return point | extra


def test_the_example_curve_is_labelled_as_an_example() -> None:
    curve = load_curve(EXAMPLE)
    assert curve.description.startswith("EXAMPLE, NOT A MEASUREMENT")
    assert curve.capacity == 12.0 and len(curve.points) == 8  # the 14 req/s point saturated
    assert curve.gauges == ("kv_cache_usage", "num_requests_waiting", "num_requests_running", "preemptions_per_s")


def test_finite_runs_short_of_their_rate_with_a_short_queue_are_not_saturated() -> None:
    # the H200 curve's shape: 300-request runs complete 72-83% of their rate by their span and tail,
    # the queue stays under 1 while the all-at-once run holds 73 waiting. The old rule (offered more
    # than the highest finite throughput, 23.2, and completed < 95%) dropped 24 and 32 req/s.
    runs = [flat(8, 6.68, num_requests_waiting=0.13), flat(16, 12.83, num_requests_waiting=0.37),
            flat(24, 18.47, ttft=(41, 59, 203), num_requests_waiting=0.47),
            flat(32, 23.17, ttft=(51, 87, 296), num_requests_waiting=0.85),
            flat(1, 29.51, ttft=(2147, 7841, 8217), num_requests_waiting=73.3) | {"request_rate": "inf"}]
    curve = parse_curve(runs)
    assert [p.request_rate for p in curve.points] == [8, 16, 24, 32]
    # the unbounded run's 29.5 req/s, but the replica kept up with 32
    assert curve.capacity == 32
    assert curve.highest_rate_within(0.5) == 32


def test_a_run_whose_queue_builds_is_saturated_and_the_burst_no_longer_counts() -> None:
    runs = [flat(8, 6.7, num_requests_waiting=0.1), flat(16, 12.8, num_requests_waiting=0.4),
            flat(40, 27.0, num_requests_waiting=20.0),  # a quarter of the unbounded run's 73 is 18.3
            flat(1, 29.5, num_requests_waiting=73.0) | {"request_rate": "inf"}]
    curve = parse_curve(runs)
    assert [p.request_rate for p in curve.points] == [8, 16]
    assert curve.capacity == 27.0  # the saturated run's throughput, not the burst's 29.5


def test_without_the_gauge_a_first_token_ten_times_slower_marks_saturation() -> None:
    curve = parse_curve([flat(1, 0.8), flat(2, 1.6, ttft=(400, 500, 900)), flat(3, 2.2, ttft=(600, 900, 1500)),
                         flat(1, 5.0) | {"request_rate": "inf"}])
    assert [p.request_rate for p in curve.points] == [1, 2]  # 400 ms is 8x the 50 ms at 1 req/s, 600 is 12x
    assert curve.capacity == 2.2
    # an unbounded run that queued nothing says nothing about the queue: the TTFT rule alone
    curve = parse_curve([flat(1, 0.8, num_requests_waiting=0.0), flat(2, 1.6, num_requests_waiting=0.5),
                         flat(1, 5.0, num_requests_waiting=0.0) | {"request_rate": "inf"}])
    assert [p.request_rate for p in curve.points] == [1, 2] and curve.capacity == 5.0


def test_bench_serve_runs_carry_what_replays_them() -> None:
    run = flat(2, 1.8) | {"num_requests": 300, "duration_s": 166.7}
    curve = parse_curve({"workload": {"seed": 7, "burstiness": 1.0, "max_concurrency": None},
                         "runs": [run, flat(4, 3.6) | {"num_requests": 300, "duration_s": 83.3}]})
    assert curve.arrivals == (7, 1.0)
    assert (curve.points[0].num_requests, curve.points[0].duration_s) == (300, 166.7)
    # sends held back by a concurrency limit are not at their arrival times
    assert parse_curve({"workload": {"seed": 7, "max_concurrency": 8}, "runs": [run, flat(4)]}).arrivals is None


def test_the_slo_rate_is_below_the_first_miss_of_a_noisy_curve() -> None:
    # P99 TTFT 100, 200 (miss at 150), then 120 ms again at 3 req/s: the limit is crossed between 1 and 2
    curve = parse_curve([flat(1, ttft=(50, 80, 100)), flat(2, ttft=(50, 80, 200)), flat(3, ttft=(50, 80, 120)),
                         flat(4, 3.5, ttft=(600, 800, 900))])  # saturated: TTFT P50 12x
    assert curve.highest_rate_within(0.150) == pytest.approx(1.5)
    assert curve.highest_rate_within(0.250) == curve.capacity == 3.5


def test_bench_serve_output_is_read_as_it_is() -> None:
    def run(rate: float | str, served: float, ttft_p99: float) -> dict[str, Any]:
        pct = {"mean": 0.0, "p50": 0.05, "p90": 0.08, "p99": ttft_p99, "max": 1.0}
        return {"request_rate": rate, "request_throughput": served, "ttft": pct,
                "itl": {**pct, "p99": 0.02, "p90": 0.015, "p50": 0.01}, "tpot": None,
                "e2e": {**pct, "p50": 1.0, "p90": 1.2, "p99": 1.5}}
    curve = parse_curve({"model": "m", "runs": [run(2, 2.0, 0.1), run(4, 3.99, 0.3), run("inf", 5.2, 9.0)]})
    assert [p.request_rate for p in curve.points] == [2, 4]
    assert curve.capacity == 5.2 and curve.gauges == ()
    assert curve.percentiles("ttft", 3)[2] == pytest.approx(0.2)


def test_percentiles_interpolate_in_the_rate_and_extend_to_the_capacity() -> None:
    curve = parse_curve([flat(1, ttft=(50, 80, 100)), flat(3, ttft=(70, 120, 200)), flat(6, 4.0, ttft=(700, 900, 1000))])
    assert curve.capacity == 4.0
    assert curve.percentiles("ttft", 2) == pytest.approx([0.06, 0.1, 0.15])
    assert curve.percentiles("ttft", 0.1) == pytest.approx([0.05, 0.08, 0.1])  # held below
    assert curve.percentiles("ttft", 4) == pytest.approx([0.08, 0.14, 0.25])  # the last segment, extended
    assert curve.percentiles("ttft", 9) == pytest.approx(curve.percentiles("ttft", 4))  # capped at capacity
    # a last segment that falls (noise) is held at the last point past it, never extended down to 0
    falling = parse_curve([flat(1, ttft=(70, 120, 200)), flat(3, ttft=(50, 80, 100)),
                           flat(1, 8.0) | {"request_rate": "inf"}])
    assert falling.capacity == 8.0
    assert falling.percentiles("ttft", 8) == pytest.approx([0.05, 0.08, 0.1])
    assert falling.percentiles("ttft", 2) == pytest.approx([0.06, 0.1, 0.15])


def test_the_highest_rate_meeting_the_slo() -> None:
    curve = parse_curve([flat(1, ttft=(50, 80, 100)), flat(3, ttft=(70, 120, 300))])
    assert curve.highest_rate_within(0.2) == pytest.approx(2.0, abs=1e-6)
    assert curve.highest_rate_within(0.05) is None
    assert curve.highest_rate_within(0.2, e2e_s=1.0) is None


def test_draws_through_three_percentiles_give_them_back() -> None:
    u = np.random.default_rng(0).exponential(size=400_000)
    drawn = sample(np.array([[0.1, 0.3, 0.9], [1.0, 1.1, 1.5]])[:, None, :], u)
    assert drawn.shape == (2, len(u))
    assert np.percentile(drawn[0], [50, 90, 99]) == pytest.approx([0.1, 0.3, 0.9], rel=0.02)
    assert np.percentile(drawn[1], [50, 90, 99]) == pytest.approx([1.0, 1.1, 1.5], rel=0.02)
    assert drawn.min() >= 0
    order = np.argsort(u)  # one draw per request for every kind: slow to start, slow to finish
    assert np.all(np.diff(drawn[:, order], axis=1) >= 0)


@pytest.mark.parametrize(("body", "message"), [
    ({"points": []}, "expected a list of points"),
    ([flat(1), {"request_rate": 2, "request_throughput": 2}], "point 1 (request_rate 2): ttft needs p50, p90 and p99"),
    ([flat(1), flat(2, ttft=(90, 80, 100))], "point 1 (request_rate 2): ttft percentiles must not decrease"),
    ([flat(1), flat(0)], "point 1: request_rate must be positive, not 0"),
    ([flat(1), flat(-2)], "point 1 (request_rate -2): request_rate must be a non-negative number"),
    ([flat(1), flat(2) | {"request_throughput": "fast"}], "request_throughput must be a non-negative number"),
    ([flat(1), flat(2, 1.0, ttft=(600, 700, 800))], "at least two unsaturated points, not 1"),
    ([flat(1), flat(2) | {"num_requests": 300}], "num_requests and duration_s go together"),
    ({"workload": {"seed": "zero"}, "runs": [flat(1), flat(2)]}, "workload: seed must be an integer"),
    ([flat(1, kv_cache_usage=0.1), flat(2)], "kv_cache_usage: on 1 of 2 unsaturated points"),
    ([flat(1), flat(1)], "two unsaturated points have the same request_rate"),
])
def test_a_bad_curve_names_the_point_and_the_key(body: Any, message: str) -> None:
    with pytest.raises(CurveError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_curve(body)


def test_a_curve_file_that_is_not_json_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "curve.json"
    bad.write_text("request_rate,ttft\n")
    with pytest.raises(CurveError, match=f"{bad}: not JSON"):
        load_curve(bad)
    with pytest.raises(CurveError, match="No such file"):
        load_curve(tmp_path / "missing.json")


def test_a_csv_trace_is_linear_between_its_points(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("time_s,rate\n0,10\n100,30\n200,30\n")
    trace = load_trace(path)
    assert (trace.duration_s, trace.peak) == (200, 30)
    ticks = trace.tick_rates(50)
    assert ticks == pytest.approx([15, 25, 30, 30])


def test_a_json_trace_takes_objects_or_pairs(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps([{"time_s": 0, "rate": 1}, [60, 2]]))
    assert load_trace(path).tick_rates(30) == pytest.approx([1.25, 1.75])


@pytest.mark.parametrize(("text", "suffix", "message"), [
    ("time,rate\n0,1\n", ".csv", "needs the header time_s,rate"),
    ("time_s,rate\n0,1\n10,x\n", ".csv", "point 1: time_s and rate must be numbers"),
    ("time_s,rate\n5,1\n10,1\n", ".csv", "point 0: times must start at 0"),
    ("time_s,rate\n0,1\n10,1\n10,2\n", ".csv", "point 2: times must start at 0 and increase"),
    ("time_s,rate\n0,1\n10,-1\n", ".csv", "point 1: rate must be a non-negative number"),
    ("time_s,rate\n0,1\n", ".csv", "at least two points"),
    ('{"time_s": 0}', ".json", "a JSON trace is a list"),
    ('[[0, 1], [1]]', ".json", "point 1: expected"),
])
def test_a_bad_trace_names_the_row(tmp_path: Path, text: str, suffix: str, message: str) -> None:
    path = tmp_path / f"trace{suffix}"
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_the_built_in_day_has_a_trough_peaks_and_bursts() -> None:
    calm = day_trace(100.0, bursts=0)
    hours = calm.times / 3600
    assert calm.peak == pytest.approx(100.0)
    assert calm.rates[(hours > 3) & (hours < 5)].max() < 25  # night
    assert calm.rates[(hours > 9) & (hours < 17)].min() > 60  # working day
    bursty = day_trace(100.0, bursts=8, seed=3)
    jumps = np.diff(bursty.rates) / np.maximum(bursty.rates[:-1], 1e-9)
    assert bursty.peak > 120 and jumps.max() > 0.05 > np.diff(calm.rates).max() / calm.peak
    assert np.array_equal(bursty.rates, day_trace(100.0, bursts=8, seed=3).rates)
    squeezed = day_trace(100.0, duration_s=3600, bursts=0)
    assert squeezed.duration_s == pytest.approx(3600) and squeezed.peak == pytest.approx(100.0)
    assert math.isclose(float(np.argmax(squeezed.rates)) / len(squeezed.rates),
                        float(np.argmax(calm.rates)) / len(calm.rates), abs_tol=0.01)


@pytest.mark.parametrize("percentiles", [(0.1, 0.3, 0.9), (0.5, 0.5, 0.9), (0.1, 0.3, 0.3), (0.2, 0.2, 0.2)])
def test_the_share_within_a_limit_is_that_of_the_draws(percentiles: tuple[float, float, float]) -> None:
    drawn = sample(np.array(percentiles), np.random.default_rng(0).exponential(size=200_000))
    limits = np.array([-0.1, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.9, 2.0])
    assert share_within(np.array(percentiles), limits) == pytest.approx([(drawn <= x).mean() for x in limits],
                                                                         abs=0.004)
