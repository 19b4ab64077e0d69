"""The example manifests scale on a signal that meets the SLO: each one's `spec.autoscaling`, as
the operator reads it, run by the fleet simulator on the measured H200 curve (the examples serve
Llama-3-8B on such GPUs) through two hours that rise, burst and fall, with a 45 s start-up."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from kvpilot.bench.arrival_trace import Trace
from kvpilot.bench.capacity_curve import load_curve
from kvpilot.bench.fleet import simulate
from kvpilot.bench.fleet_inputs import Pipeline, Policy, SimConfig
from kvpilot.operator.reconcile import parse

ROOT = Path(__file__).resolve().parents[2]
CURVE = load_curve(ROOT / "benchmarks" / "data" / "serve-curve-h200-async.json")
SCALED = [(path, doc) for path in sorted((ROOT / "examples").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
          if (doc["spec"].get("autoscaling") or {}).get("enabled")]


def hours() -> Trace:
    """40 req/s rising to 120 over an hour, a 1.5x burst on a one-minute rise held five minutes,
    then down to 60."""
    t = np.array([0.0, 3600.0, 4200.0, 4260.0, 4560.0, 4620.0, 6000.0, 7200.0])
    return Trace(t, np.array([40.0, 120.0, 120.0, 180.0, 180.0, 120.0, 120.0, 60.0]), "two hours")


def test_an_example_scales() -> None:
    assert [path.name for path, _ in SCALED] == ["llama-3-8b-autotune.yaml"]


@pytest.mark.parametrize(("path", "doc"), SCALED, ids=lambda v: v.name if isinstance(v, Path) else "")
def test_the_examples_scaling_meets_the_slo(path: Path, doc: dict[str, Any]) -> None:
    spec = parse({**doc, "metadata": {**doc["metadata"], "namespace": "default", "uid": "uid"}}).scaling
    assert spec.mode == "builtin" and spec.forecast is not None
    policy = Policy(path.name, spec, Pipeline(spec.interval), spec.min_replicas)
    result = simulate(CURVE, hours(), policy, SimConfig(startup_s=45.0, slo_ttft_s=0.5))
    assert result.slo_attainment >= 0.999
    # the serving-engine rule the example had before scales nothing on this GPU
    article = simulate(CURVE, hours(), dataclasses.replace(policy, spec=dataclasses.replace(spec, target=0.85)),
                       SimConfig(startup_s=45.0, slo_ttft_s=0.5))
    assert article.slo_attainment < 0.5
