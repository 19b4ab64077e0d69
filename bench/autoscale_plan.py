"""`kvpilot bench autoscale`'s plan: which fleets are simulated on one trace, each a *family* (a
mode on a signal, or a yardstick) at each of its *settings*.

Families:
* `static-peak` — a fixed fleet sized for the trace's peak at the highest per-replica rate that
  meets the SLO;
* `builtin:<signal>` — `mode: builtin` with its forecast (`operator/autoscale/forecast.py`), at
  each headroom, tolerance and forecast horizon; `builtin-reactive:<signal>` the same without;
* `hpa:<signal>` and `keda:<signal>` — the HPA and KEDA as the operator deploys them
  (`autoscale_modes.py`), on the per-pod signals they read (queue, KV-cache usage);
* `reactive-bound` and `clairvoyant` — yardsticks scaled on the trace's own rate, now and one
  start-up plus one interval ahead (`fleet.Foresight`).
A setting's target is its signal's value on the curve at `headroom` times the SLO rate, so every
family aims at the same load per replica at the same headroom.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvpilot.bench.arrival_trace import Trace
from kvpilot.bench.capacity_curve import CapacityCurve
from kvpilot.bench.fleet_inputs import Foresight, Pipeline, Policy, SimConfig
from kvpilot.operator.autoscale import ScalingSpec
from kvpilot.operator.autoscale.scaling_spec import Forecasting, Metric

MODES = ("builtin", "builtin-reactive", "hpa", "keda")
SIGNALS: dict[str, str | None] = {"kvCacheUsage": "kv_cache_usage", "waitingPerReplica": "num_requests_waiting",
                                  "preemptionRate": "preemptions_per_s", "ttftP99": None}
PROMETHEUS_SIGNALS = ("kvCacheUsage", "waitingPerReplica")  # what hpa and keda are simulated on
STATIC, BOUND, CLAIRVOYANT = "static-peak", "reactive-bound", "clairvoyant"


@dataclass(frozen=True)
class Settings:
    """The grid every family runs on (the yardsticks on the headrooms alone)."""

    headrooms: tuple[float, ...]
    tolerances: tuple[float, ...]
    horizons: tuple[float | None, ...]  # forecast horizons in seconds; None: start-up + interval
    lookback_s: float
    interval_s: float
    window_s: float
    max_replicas: int | None = None  # None: twice the static fleet


@dataclass
class Plan:
    policies: list[Policy] = field(default_factory=list)
    families: dict[str, str] = field(default_factory=dict)  # policy name -> its family
    settings: dict[str, str] = field(default_factory=dict)  # policy name -> its setting, described
    targets: dict[str, str] = field(default_factory=dict)  # policy name -> its target, described
    skipped: dict[str, str] = field(default_factory=dict)  # family -> why it was not simulated

    def add(self, family: str, setting: str, policy: Policy, target: str) -> None:
        policy = replace(policy, name=f"{family} {setting}".strip())
        self.policies.append(policy)
        self.families[policy.name] = family
        self.settings[policy.name] = setting
        self.targets[policy.name] = target


def plan(curve: CapacityCurve, trace: Trace, slo_rate: float, config: SimConfig, modes: Sequence[str],
         signals: Sequence[str], grid: Settings) -> Plan:
    out = Plan()
    static = max(1, math.ceil(trace.peak / slo_rate))
    max_replicas = grid.max_replicas or 2 * static
    operator = Pipeline(grid.interval_s)
    prometheus = Pipeline(config.cluster.prometheus_interval_s, config.cluster.prometheus_phase_s)
    out.add(STATIC, "", Policy(STATIC, None, operator, static),
            f"{static} replicas ({trace.peak:.1f} req/s / {slo_rate:.2f} per replica)")
    base = ScalingSpec(enabled=True, max_replicas=max_replicas, window_s=grid.window_s, interval_s=grid.interval_s)
    for headroom in grid.headrooms:
        rate = headroom * slo_rate
        initial = min(max_replicas, max(1, math.ceil(float(trace.rates[0]) / rate)))
        targets = _targets(curve, rate, signals, out.skipped)
        for tolerance in grid.tolerances:
            setting = f"h{headroom:g} t{tolerance:g}"
            for metric, target in targets.items():
                spec = replace(base, metric=metric, target=target, tolerance=tolerance)
                described = f"{metric} {target:.3g}"
                if "builtin" in modes:
                    for horizon in grid.horizons:
                        forecasting = Forecasting(horizon, grid.lookback_s)
                        out.add(f"builtin:{metric}", f"{setting} {_horizon(horizon)}",
                                Policy("", replace(spec, forecast=forecasting), operator, initial), described)
                if "builtin-reactive" in modes:
                    out.add(f"builtin-reactive:{metric}", setting, Policy("", spec, operator, initial), described)
                for mode in ("hpa", "keda"):
                    if mode not in modes:
                        continue
                    if metric not in PROMETHEUS_SIGNALS:
                        out.skipped[f"{mode}:{metric}"] = f"simulated on {' and '.join(PROMETHEUS_SIGNALS)} only"
                        continue
                    window = {"window_s": None, "interval_s": None} if mode == "hpa" else {}
                    mode_spec = replace(spec, mode=mode, **window)  # type: ignore[arg-type]
                    out.add(f"{mode}:{metric}", setting, Policy("", mode_spec, prometheus, initial), described)
        for family, seconds in ((BOUND, 0.0), (CLAIRVOYANT, config.startup_s + grid.interval_s)):
            out.add(family, f"h{headroom:g}", Policy("", base, operator, initial, Foresight(seconds, rate)),
                    f"the trace's rate{f' {seconds:g} s ahead' if seconds else ''}, {rate:.3g} req/s per replica")
    return out


def _targets(curve: CapacityCurve, rate: float, signals: Sequence[str], skipped: dict[str, str]) -> dict[Metric, float]:
    """Each signal's value on the curve at `rate` per replica."""
    targets: dict[Metric, float] = {}
    for metric in signals:
        gauge = SIGNALS[metric]
        if gauge is not None and gauge not in curve.gauges:
            skipped[f"*:{metric}"] = f"the curve carries no {gauge}"
            continue
        value = curve.percentiles("ttft", rate)[2] if gauge is None else curve.gauge(gauge, rate)
        if value <= 0:
            skipped[f"*:{metric}"] = f"{metric} is 0 on the curve at {rate:.3g} req/s per replica: no target to hold"
            continue
        targets[metric] = value  # type: ignore[index]
    return targets


def _horizon(seconds: float | None) -> str:
    return "z=start-up+interval" if seconds is None else f"z{seconds:g}"
