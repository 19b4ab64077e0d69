"""The fleet simulator: its self-check against the capacity curve (and that the check fails on a
replica model that is wrong), a fixed fleet, overload, the scale-up delay, and drained scale-downs."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpilot.bench import fleet
from kvpilot.bench.arrival_trace import Trace
from kvpilot.bench.autoscale_scrapes import TTFT_BUCKETS
from kvpilot.bench.capacity_curve import load_curve, parse_curve
from kvpilot.bench.fleet import simulate
from kvpilot.bench.fleet_inputs import Foresight, Pipeline, Policy, SimConfig
from kvpilot.bench.loadgen import arrival_times
from kvpilot.bench.self_check import finite_run_throughput, self_check
from kvpilot.operator.autoscale import ScalingSpec

ROOT = Path(__file__).resolve().parents[2]
CURVE = load_curve(Path(__file__).parent / "data" / "example-capacity-curve.json")
CONFIG = SimConfig(startup_s=120.0, slo_ttft_s=1.0)
SCRAPES = Pipeline(15.0)


def steady(rate: float, duration_s: float) -> Trace:
    return Trace(np.array([0.0, duration_s]), np.array([rate, rate]), "steady")


def step(low: float, high: float, at_s: float, duration_s: float) -> Trace:
    return Trace(np.array([0.0, at_s, at_s + 1, duration_s]), np.array([low, low, high, high]), "step")


def test_one_simulated_replica_reproduces_the_curve_within_10_percent() -> None:
    check = self_check(CURVE, CONFIG, requests_per_point=5000)
    assert check.passed, check.describe()
    assert len(check.rows) == len(CURVE.points)
    assert {"ttft_p99", "itl_p90", "e2e_p50", "throughput"} <= check.rows[0].errors.keys()


def test_the_self_check_fails_on_a_replica_model_that_ignores_the_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    def medians_only(percentiles: np.ndarray, u: np.ndarray) -> np.ndarray:
        p50 = np.asarray(percentiles)[..., 0]
        return np.broadcast_to(p50, np.broadcast_shapes(p50.shape, u.shape)).copy()
    monkeypatch.setattr(fleet, "sample", medians_only)
    check = self_check(CURVE, CONFIG, requests_per_point=2000)
    assert not check.passed and "FAILED" in check.describe()


def test_the_histogram_buckets_are_the_runtimes() -> None:
    tree = ast.parse((ROOT / "runtime" / "server" / "metrics.py").read_text())
    runtime = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and any(getattr(t, "id", None) == "_LATENCY_BUCKETS" for t in node.targets))
    assert TTFT_BUCKETS == runtime


def test_a_fleet_within_its_capacity_meets_the_slo_and_costs_its_size() -> None:
    result = simulate(CURVE, steady(20.0, 3600), Policy("static", None, SCRAPES, 4), CONFIG)
    assert result.slo_attainment == 1.0 and result.num_failed == 0
    assert result.replica_hours == pytest.approx(4.0)
    assert result.num_requests == pytest.approx(72_000, rel=0.02)
    assert [t[2] for t in result.timeline] == [4] * 60


def test_an_overloaded_replica_queues_and_misses_the_slo() -> None:
    result = simulate(CURVE, steady(15.0, 600), Policy("static", None, SCRAPES, 1), CONFIG, record_latencies=True)
    ttft = np.concatenate(result.latencies["ttft"])
    # 3 req/s beyond its capacity of 12: the queue grows by 3 a second until a request would wait
    # 60 s, when clients start giving up (after 240 s)
    assert ttft[:12 * 60].max() < 20
    assert 60 < ttft[-100:].min() < 62
    assert result.slo_attainment < 0.2


def test_no_ready_replica_fails_every_request() -> None:
    result = simulate(CURVE, steady(5.0, 120), Policy("none", None, SCRAPES, 0), CONFIG)
    assert result.num_failed == result.num_requests > 0 and result.slo_attainment == 0.0


def test_a_step_in_load_is_met_once_new_replicas_are_ready() -> None:
    spec = ScalingSpec(enabled=True, metric="kvCacheUsage", target=0.6, max_replicas=20)
    policy = Policy("kv", spec, SCRAPES, 2)
    result = simulate(CURVE, step(10.0, 60.0, 600, 1800), policy, CONFIG)
    by_minute = {round(t[0]): t for t in result.timeline}
    assert by_minute[600][2:4] == (2, 2)  # before the step: 10 req/s on two replicas is within the target
    # the first decision after the step orders replicas; none serves before startup_s has passed
    assert by_minute[660][2] > 2 and by_minute[720][3] == 2
    first_ready = min(t[0] for t in result.timeline if t[3] > 2)
    assert first_ready >= 600 + CONFIG.startup_s
    assert by_minute[1800][3] >= 60 / 10.3  # enough Ready replicas for the SLO in the end
    assert min(t[4] for t in result.timeline if t[0] > 1300) == 1.0
    assert 0.5 < result.slo_attainment < 0.9  # the minutes before the new replicas were ready cost
    assert result.num_scale_events >= 2


def test_the_reactive_bound_follows_the_present_rate_and_pays_the_start_up_delay() -> None:
    spec = ScalingSpec(enabled=True, max_replicas=20)  # behavior and bounds; the yardstick reads no metric
    policy = Policy("reactive-bound", spec, SCRAPES, 2, Foresight(0.0, 8.0))
    result = simulate(CURVE, step(10.0, 60.0, 600, 1800), policy, CONFIG)
    by_minute = {round(t[0]): t for t in result.timeline}
    assert by_minute[600][2:4] == (2, 2)  # ceil(10 / 8): the bound holds no more than the rate asks
    assert by_minute[660][2] == 8  # ceil(60 / 8) ordered within the minute after the step
    assert by_minute[720][3] == 2  # ...and none of them Ready before the start-up delay
    assert min(t[0] for t in result.timeline if t[3] > 2) >= 600 + CONFIG.startup_s
    assert result.num_scale_events == 2  # 2 -> 6 -> 8: the scaleUp policies allow 4 pods a period
    assert 0.5 < result.slo_attainment < 0.95  # it loses what the start-up delay loses, as any reactive policy


def test_a_clairvoyant_fleet_is_ready_before_the_load_arrives() -> None:
    spec = ScalingSpec(enabled=True, max_replicas=20)
    seconds = CONFIG.startup_s + spec.interval
    policy = Policy("clairvoyant", spec, SCRAPES, 2, Foresight(seconds, 8.0))
    result = simulate(CURVE, step(10.0, 60.0, 600, 1800), policy, CONFIG)
    by_minute = {round(t[0]): t for t in result.timeline}
    assert by_minute[420][2] == 2  # nothing ordered before the step is within its sight
    assert by_minute[600][2] == 8  # ordered in time, the scaleUp policies' limits included...
    assert by_minute[660][3] == 8  # ...so every replica is Ready as the step comes
    assert result.slo_attainment == 1.0 and result.num_failed == 0


def test_a_foresight_must_be_possible() -> None:
    with pytest.raises(ValueError, match="seconds: must be >= 0"):
        Foresight(-1.0, 8.0)
    with pytest.raises(ValueError, match="rate_per_replica: must be positive"):
        Foresight(0.0, 0.0)


def test_replicas_scaled_down_drain_and_cost_until_their_last_request() -> None:
    spec = ScalingSpec(enabled=True, metric="kvCacheUsage", target=0.6, max_replicas=20)
    policy = Policy("kv", spec, SCRAPES, 8)
    result = simulate(CURVE, steady(10.0, 1800), policy, CONFIG)
    replicas = [t[2] for t in result.timeline]
    assert replicas[0] == 8 and replicas[-1] == 2  # 10 req/s is two replicas' worth at the target
    assert replicas.index(2) * 60 >= 300  # not before the scale-down stabilization window
    assert result.slo_attainment == 1.0
    # six replicas went in the minute before the timeline first shows 2, and drained for seconds
    removed_by = replicas.index(2) * 60 + 60
    assert 2 * 1800 + 6 * (removed_by - 60) < result.replica_seconds < 2 * 1800 + 6 * (removed_by + 10)


def test_the_same_seed_gives_the_same_day() -> None:
    spec = ScalingSpec(enabled=True, metric="ttftP99", target=0.4, max_replicas=20)
    policy = Policy("ttft", spec, SCRAPES, 2)
    trace = step(5.0, 40.0, 300, 1200)
    one, two = simulate(CURVE, trace, policy, CONFIG), simulate(CURVE, trace, policy, CONFIG)
    assert (one.num_met, one.replica_seconds, one.timeline) == (two.num_met, two.replica_seconds, two.timeline)
    other = simulate(CURVE, trace, policy, dataclasses.replace(CONFIG, seed=1))
    assert other.num_requests != one.num_requests


def test_a_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="startup_s: must be >= 0"):
        SimConfig(startup_s=-1)
    with pytest.raises(ValueError, match="slo_ttft_s: must be positive"):
        SimConfig(slo_ttft_s=0)
    with pytest.raises(ValueError, match=r"pending_s: must lie in \[0, startup_s = 4\]"):
        SimConfig(startup_s=4)


def finite_runs(record_runs: bool) -> dict[str, Any]:
    """A bench serve file of 50-request runs at 5 and 10 req/s whose measured durations are what
    such runs take on a replica of these latencies: the arrivals' span (bench serve's, seed 0)
    plus the last requests' E2E, about its P90 (1.2 s)."""
    runs = []
    for rate in (5.0, 10.0):
        span = float(arrival_times(50, rate, 1.0, np.random.default_rng(0))[-1])
        run = {"request_rate": rate, "request_throughput": 50 / (span + 1.2),
               "ttft": {"p50": 0.05, "p90": 0.08, "p99": 0.12}, "itl": {"p50": 0.01, "p90": 0.012, "p99": 0.015},
               "e2e": {"p50": 1.0, "p90": 1.2, "p99": 1.5}, "num_requests": 50, "duration_s": span + 1.2}
        runs.append(run if record_runs else {k: v for k, v in run.items() if k not in ("num_requests", "duration_s")})
    return {"workload": {"seed": 0, "burstiness": 1.0, "max_concurrency": None}, "runs": runs}


def test_a_curve_of_finite_runs_is_checked_against_the_same_finite_runs() -> None:
    # each run completed 66-80% of its rate, by its span and tail alone
    check = self_check(parse_curve(finite_runs(record_runs=True)), CONFIG, requests_per_point=2000)
    assert check.passed, check.describe()
    # the old comparison, a steady run's offered rate against the finite run's completed/duration
    steady_check = self_check(parse_curve(finite_runs(record_runs=False)), CONFIG, requests_per_point=2000)
    assert not steady_check.passed and "throughput" in steady_check.describe()
    assert steady_check.rows[1].errors["throughput"] > 0.2


def test_the_finite_run_is_bench_serves_own_arrivals() -> None:
    curve = parse_curve(finite_runs(record_runs=True))
    point = curve.points[0]
    span = float(arrival_times(50, 5.0, 1.0, np.random.default_rng(0))[-1])
    # E2E 1.0-1.5 s at every draw: the last answer 1-1.9 s after the last send (the tail extended past P99)
    throughput = finite_run_throughput(curve, point, 50, np.random.default_rng(1))
    assert 50 / (span + 2.0) < throughput < 50 / (span + 1.0)
    # other arrivals (another seed) give another span
    other = parse_curve(finite_runs(record_runs=True) | {"workload": {"seed": 3, "burstiness": 1.0}})
    other_span = float(arrival_times(50, 5.0, 1.0, np.random.default_rng(3))[-1])
    assert 50 / (other_span + 2.0) < finite_run_throughput(other, other.points[0], 50, np.random.default_rng(1)) \
        < 50 / (other_span + 1.0)


def test_a_replica_that_stops_receiving_drains_at_the_lowest_loads_speed() -> None:
    unloaded, at_capacity = fleet.e2e_p50(CURVE, 0.0), fleet.e2e_p50(CURVE, CURVE.capacity)
    assert unloaded == pytest.approx(1.823) and at_capacity > 1.5 * unloaded
    # its last request 1.5 P50s from done: 1.5 of the lowest load's P50s, not of the load it arrived at
    assert fleet.drain_s(CURVE, 1.5, 0.0) == pytest.approx(1.5 * unloaded)
    # behind a queue of 24 requests: 2 s at the capacity (12 req/s), at its speed, then the rest unloaded
    done_in_queue = 2.0 / at_capacity
    assert fleet.drain_s(CURVE, 1.5, 24.0) == pytest.approx(2.0 + (1.5 - done_in_queue) * unloaded)
    assert fleet.drain_s(CURVE, 0.4, 24.0) == pytest.approx(0.4 * at_capacity)  # done while the queue drains


def test_a_finite_runs_tail_is_the_drain_not_the_loaded_latency() -> None:
    # 300 requests at 11 req/s, where the E2E P50 is 3.9 s and the P99 10.6 s: once the last is sent,
    # what is left runs at the unloaded speed (P50 1.8 s), so the run ends within ~1.8 P50s of it
    point = dataclasses.replace(CURVE.points[-1], num_requests=300, duration_s=30.0)
    assert point.request_rate == 11 and fleet.e2e_p50(CURVE, 11) == pytest.approx(3.893)
    span = float(arrival_times(300, 11.0, 1.0, np.random.default_rng(0))[-1])
    curve = parse_curve({"workload": {"seed": 0, "burstiness": 1.0}, "points": json.loads(
        (Path(__file__).parent / "data" / "example-capacity-curve.json").read_text())["points"]})
    throughput = finite_run_throughput(curve, point, 3000, np.random.default_rng(1))
    assert 300 / (span + 2 * 1.823) < throughput < 300 / (span + 1.823)


@pytest.mark.parametrize("name", ["h200"])
def test_the_measured_curves_finite_runs_pass_the_self_check(name: str) -> None:
    # the drain is what makes the 32 req/s run's throughput match (23.2 req/s measured; 19.7
    # simulated when every request ran at the offered rate's speed to the end)
    curve = load_curve(ROOT / "benchmarks" / "data" / f"autoscale-capacity-curve-{name}.json")
    check = self_check(curve, dataclasses.replace(CONFIG, slo_ttft_s=0.5), requests_per_point=5000)
    assert check.passed, check.describe()
    assert max(r.errors["throughput"] for r in check.rows) < 0.03


@pytest.mark.parametrize("seed", range(3))
def test_a_scaled_down_replica_drains_faster_than_its_load_served(seed: int) -> None:
    # four replicas at 6 req/s each, where a request takes 2.5 s (P50); at a KV target of 0.9 one
    # goes after the 300 s stabilization, and what it holds then runs at the unloaded speed
    spec = ScalingSpec(enabled=True, metric="kvCacheUsage", target=0.9, max_replicas=20)
    sim = fleet._Simulation(CURVE, steady(24.0, 900), Policy("kv", spec, SCRAPES, 4),
                            dataclasses.replace(CONFIG, seed=seed), False, None)
    result = sim.run()
    (removed,) = [r for r in sim.replicas if r.removed_at is not None]
    drain = float(sim.busy_until[removed.slot]) - removed.removed_at
    assert 0 < drain < fleet.e2e_p50(CURVE, 6.0) == pytest.approx(2.478)
    assert result.replica_seconds == pytest.approx(3 * 900 + removed.removed_at + drain)


def test_the_requests_counted_within_the_slo_are_those_the_draws_put_within_it() -> None:
    # one replica near its capacity, and then over it: the fleet counts from the distribution,
    # the record draws each request; both from the same rows and waits
    config = dataclasses.replace(CONFIG, slo_ttft_s=0.3)
    result = simulate(CURVE, step(8.0, 13.0, 300, 600), Policy("one", None, SCRAPES, 1), config,
                      record_latencies=True)
    drawn = int((np.concatenate(result.latencies["ttft"]) <= config.slo_ttft_s).sum())
    assert 0.2 < result.slo_attainment < 0.9
    assert result.num_met == pytest.approx(drawn, rel=0.05)
