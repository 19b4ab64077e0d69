"""The simulated HPA and KEDA decide as the operator deploys them (the chart's scrape interval
and adapter range, the ScaledObject's query, each HPA rule for its metric type), and in the fleet
the forecast meets a ramp the present-only builtin and the HPA meet late."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import yaml
from autotune_fixtures import summary

from kvpilot.bench.arrival_trace import Trace
from kvpilot.bench.autoscale_modes import Cluster, hpa_decision, keda_decision
from kvpilot.bench.capacity_curve import load_curve
from kvpilot.bench.fleet import simulate
from kvpilot.bench.fleet_inputs import Pipeline, Policy, SimConfig
from kvpilot.operator.autoscale import ScalerState, ScalingSpec
from kvpilot.operator.autoscale.engine_series import SERIES
from kvpilot.operator.autoscale.scaling_spec import (
    Behavior,
    Forecasting,
    ScalingPolicy,
    ScalingRules,
)

ROOT = Path(__file__).resolve().parents[2]
CURVE = load_curve(Path(__file__).parent / "data" / "example-capacity-curve.json")
WAITING = ScalingSpec(enabled=True, mode="hpa", metric="waitingPerReplica", target=4, max_replicas=20,
                      behavior=Behavior(scale_down=ScalingRules(0, (ScalingPolicy("Percent", 100, 15),))))


def queue(**pods: float) -> dict[str, object]:
    return {p: summary(p, num_requests_waiting=v) for p, v in pods.items()}


def test_the_cluster_is_the_charts() -> None:
    values = yaml.safe_load((ROOT / "charts" / "kvpilot" / "values.yaml").read_text())
    seconds = {"s": 1, "m": 60, "h": 3600}

    def duration(text: str) -> float:
        return float(text[:-1]) * seconds[text[-1]]
    assert Cluster().prometheus_interval_s == duration(values["engineMonitoring"]["interval"])
    assert Cluster().adapter_window_s == duration(values["prometheusAdapterRules"]["window"])
    # the adapter's rule and the ScaledObject's query both average the gauges over their range
    rules = (ROOT / "charts" / "kvpilot" / "templates" / "prometheus-adapter-rules-configmap.yaml").read_text()
    assert "sum(avg_over_time(<<.Series>>{<<.LabelMatchers>>}[{{ $r.window }}])) by (<<.GroupBy>>)" in rules
    for metric in ("kvCacheUsage", "waitingPerReplica"):
        assert re.fullmatch(r"sum\(avg_over_time\(\S+\{x\}\[60s\]\)\)", SERIES[metric].service_query("x", 60))


def test_hpa_leaves_pending_pods_out_and_takes_loading_ones_as_missing() -> None:
    # two ready pods at 3x the target: alone they ask for 6
    assert hpa_decision(queue(a=12, b=12), {"a": "ready", "b": "ready"}, 2, WAITING, ScalerState(), 0.0)[0] == 6
    # a loading pod (Running, no metrics) and a pending one, both at 0 on a scale-up: 24 / 4 pods / 4 = 1.5 -> 6
    phases = {"a": "ready", "b": "ready", "c": "loading", "d": "pending"}
    assert hpa_decision(queue(a=12, b=12), phases, 4, WAITING, ScalerState(), 0.0)[0] == 6
    # on a scale-down a missing pod counts at the target, a pending one not at all
    calm = queue(a=1, b=1)
    assert hpa_decision(calm, {"a": "ready", "b": "ready", "c": "pending"}, 3, WAITING, ScalerState(), 0.0)[0] == 1
    assert hpa_decision(calm, {"a": "ready", "b": "ready", "c": "loading"}, 3, WAITING, ScalerState(), 0.0)[0] == 2


def test_keda_sums_every_series_in_range_over_the_target() -> None:
    spec = dataclasses.replace(WAITING, mode="keda")
    series = list(queue(a=12, b=12, gone=4).values())  # a removed pod's series is still in the range
    assert keda_decision(series, 4, spec, ScalerState(), 0.0)[0] == 7  # ceil(28 / 4), whoever is starting
    assert keda_decision(list(queue(a=4.2, b=4.2).values()), 2, spec, ScalerState(), 0.0)[0] == 2  # within 0.1
    assert keda_decision([], 3, spec, ScalerState(), 0.0)[0] == 1  # no series reads as 0


def ramp() -> Trace:
    """20 req/s, rising to 60 over four minutes from t=1200 (faster than a replica starts), then held."""
    return Trace(np.array([0.0, 1200.0, 1440.0, 3600.0]), np.array([20.0, 20.0, 60.0, 60.0]), "ramp")


def test_in_the_fleet_the_forecast_meets_a_ramp_the_present_meets_late() -> None:
    config = SimConfig(startup_s=120.0, slo_ttft_s=0.5)
    spec = ScalingSpec(enabled=True, metric="kvCacheUsage", target=CURVE.gauge("kv_cache_usage", 6.0), max_replicas=30)
    runs = {name: simulate(CURVE, ramp(), Policy(name, s, pipeline, 4), config) for name, s, pipeline in (
        ("builtin", dataclasses.replace(spec, forecast=Forecasting()), Pipeline(15.0)),
        ("builtin-reactive", spec, Pipeline(15.0)),
        ("hpa", dataclasses.replace(spec, mode="hpa"), Pipeline(15.0, 7.0)),
        ("keda", dataclasses.replace(spec, mode="keda"), Pipeline(15.0, 7.0)))}
    outside = {name: r.num_requests - r.num_met for name, r in runs.items()}
    assert outside["builtin"] < outside["builtin-reactive"]
    assert outside["builtin"] * 3 < min(outside["hpa"], outside["keda"])
    # what the forecast orders ahead it pays for with replicas the others add later anyway
    assert runs["builtin"].replica_hours < 1.15 * runs["builtin-reactive"].replica_hours
