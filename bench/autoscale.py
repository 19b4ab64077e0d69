"""`kvpilot bench autoscale`: how the autoscaling policies would serve a day of traffic, in a
simulation of the fleet fed by one replica's measured capacity curve.

Compared, on the same arrivals (one seed):
* `static-peak` — a fixed fleet sized for the trace's peak: peak / the highest per-replica rate
  at which the curve meets the SLO;
* `hpa-queue` — an HPA on `vllm:num_requests_waiting` as prometheus-adapter's usual rule serves it:
  the latest Prometheus scrape (every `--prometheus-interval`), HPA defaults;
* `builtin-<metric>` — `mode: builtin` on each signal the curve carries, through the operator's
  own scrapes (every `--scrape-interval`) averaged over the spec's window, HPA behavior defaults;
* `builtin-kvCacheUsage@0.85` — the serving-engine rule of thumb: add replicas while KV-cache
  usage stays above 85%.
Beside them two yardsticks that no cluster can run, scaled on the trace's own rate with the same
behavior (`fleet.Foresight`):
* `reactive-bound` — knows the present arrival rate exactly, with no scrape, lag or noise: what
  the best signal a reactive policy could have would buy. A policy's gap to it at the same cost
  is its signal's; the bound's own losses are the start-up delay's;
* `clairvoyant` — knows the rate a start-up delay plus one interval ahead: what prediction could
  buy at most.
Targets, unless a policy fixes its own, are each signal's value on the curve at `--headroom` times
the highest per-replica rate that meets the SLO, so every policy aims at the same load per replica.
A lower headroom buys slack for what a reactive policy cannot see coming (a burst, a ramp faster
than a replica starts) with replica-hours; given several, every policy whose target follows from
it is simulated at each (named `POLICY h0.6`), and the summary shows each policy at its best:
the cheapest setting with at least `--slo-goal` of requests within the SLO, else the one with the
highest share.

Before the comparison the simulator checks itself: one simulated replica, offered each rate of
the curve, must reproduce the curve's P50/P90/P99 TTFT, ITL and E2E (in a long steady run) and its
throughput (in the same finite run bench serve made, `self_check.py`) within 10%;
when it does not, the results are still shown and the command exits with 1. Results: a table, and
with `--output FILE` JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvpilot.bench.arrival_trace import DAY_S, Trace, TraceError, day_trace, load_trace
from kvpilot.bench.capacity_curve import CapacityCurve, CurveError, load_curve
from kvpilot.bench.flags import fraction, percent, positive_float, tolerance
from kvpilot.bench.fleet import Foresight, Pipeline, Policy, SimConfig, simulate
from kvpilot.bench.self_check import self_check
from kvpilot.operator.autoscale import ScalingSpec
from kvpilot.operator.autoscale.scaling_spec import DEFAULT_TOLERANCE

ARTICLE_KV_TARGET = 0.85
_SIGNALS = {"kvCacheUsage": "kv_cache_usage", "waitingPerReplica": "num_requests_waiting",
            "preemptionRate": "preemptions_per_s", "ttftP99": None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("inputs")
    g.add_argument("--capacity-curve", required=True, metavar="FILE", type=Path,
                   help="one replica's measured curve: kvpilot bench serve --output, or points as the "
                        "module documents")
    g.add_argument("--trace", default=None, metavar="FILE", type=Path,
                   help="arrival rate over time, CSV time_s,rate or JSON (default: a built-in day with bursts)")
    g.add_argument("--peak-rate", type=positive_float, default=None, metavar="REQ/S",
                   help="built-in trace: the day's peak before bursts (default: 8 replicas' worth at the SLO)")
    g.add_argument("--duration", type=positive_float, default=DAY_S, metavar="SECONDS",
                   help="built-in trace: the day squeezed into this long")
    g.add_argument("--bursts", type=int, default=8, help="built-in trace: bursts in the day")
    g.add_argument("--write-trace", default=None, metavar="FILE", type=Path,
                   help="write the trace simulated as CSV (time_s,rate), which --trace reads back")
    g = parser.add_argument_group("SLO and targets")
    g.add_argument("--slo-ttft-ms", type=positive_float, default=1000.0, help="a request meets the SLO within this TTFT")
    g.add_argument("--slo-e2e-ms", type=positive_float, default=None, help="...and, when given, within this E2E")
    g.add_argument("--headroom", type=fraction, nargs="+", default=[0.8], metavar="SHARE",
                   help="targets are the signals' values at this share of the highest rate meeting the SLO; "
                        "several: each policy at each, and each shown at its best")
    g.add_argument("--slo-goal", type=percent, default=99.0, metavar="PERCENT",
                   help="the share of requests within the SLO a setting must reach to count as its policy's best")
    g.add_argument("--hpa-target", type=positive_float, default=None, metavar="WAITING",
                   help="hpa-queue's target, requests waiting per pod (default: as the builtin's, from the curve)")
    g.add_argument("--max-replicas", type=int, default=None, help="the policies' maxReplicas (default: 2x static)")
    g.add_argument("--tolerance", type=tolerance, default=DEFAULT_TOLERANCE, metavar="SHARE",
                   help="the policies' tolerance: a ratio to the target within it changes nothing (default: the "
                        "HPA's 0.1)")
    g = parser.add_argument_group("cluster")
    g.add_argument("--startup-delay", type=float, default=120.0, metavar="SECONDS",
                   help="a new replica's time to Ready (image, model load)")
    g.add_argument("--scrape-interval", type=positive_float, default=15.0, metavar="SECONDS",
                   help="the operator's scrapes of every pod (builtin)")
    g.add_argument("--prometheus-interval", type=positive_float, default=30.0, metavar="SECONDS",
                   help="Prometheus's scrapes, which the HPA reads through prometheus-adapter")
    g.add_argument("--metrics-lag", type=float, default=5.0, metavar="SECONDS",
                   help="a scrape's age before a decision can read it")
    g.add_argument("--request-timeout", type=positive_float, default=60.0, metavar="SECONDS",
                   help="clients give up on a request queued this long")
    g = parser.add_argument_group("simulation")
    g.add_argument("--tick", type=positive_float, default=1.0, metavar="SECONDS")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--self-check-requests", type=int, default=20_000,
                   help="requests per curve point in the simulator's self-check")
    g.add_argument("--output", default=None, metavar="FILE", help="write JSON here and a PNG beside it")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        curve = load_curve(args.capacity_curve)
        config = SimConfig(tick_s=args.tick, startup_s=args.startup_delay, metrics_lag_s=args.metrics_lag,
                           slo_ttft_s=args.slo_ttft_ms / 1000, request_timeout_s=args.request_timeout,
                           slo_e2e_s=None if args.slo_e2e_ms is None else args.slo_e2e_ms / 1000, seed=args.seed)
        slo_rate = curve.highest_rate_within(config.slo_ttft_s, config.slo_e2e_s)
        if slo_rate is None:
            raise ValueError(f"slo: even the curve's lowest rate ({curve.points[0].request_rate:g} req/s) misses "
                             f"P99 TTFT {args.slo_ttft_ms:g} ms; no fleet can meet it")
        trace = _trace(args, slo_rate)
        if args.write_trace is not None:
            trace.write_csv(args.write_trace)
        plan = _plan(args, curve, trace, slo_rate)
        check = self_check(curve, config, args.self_check_requests)
    except (CurveError, TraceError, ValueError, OSError) as e:
        print(f"kvpilot bench autoscale: error: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from kvpilot.bench.autoscale_report import best_settings, print_best, print_table, write_outputs

    print(check.describe())
    ticks = math.ceil(trace.duration_s / config.tick_s)
    results = []
    with tqdm(total=ticks * len(plan.policies), unit="tick", disable=args.disable_tqdm, file=sys.stderr) as bar:
        for policy in plan.policies:
            bar.set_description(policy.name)
            results.append(simulate(curve, trace, policy, config, progress=bar.update))
    print_table(results, plan.targets, plan.skipped)
    best = best_settings(results, plan.families, args.slo_goal / 100)
    if len(args.headroom) > 1:
        print_best(results, best, args.slo_goal / 100)
    if args.output:
        body = {"command": ["kvpilot", *sys.argv[1:]], "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "curve": {"file": str(args.capacity_curve), "description": curve.description,
                          "capacity": curve.capacity, "slo_rate_per_replica": slo_rate,
                          "target_rate_per_replica": plan.target_rates},
                "trace": {"description": trace.description, "duration_s": trace.duration_s, "peak": trace.peak},
                "config": asdict(config), "prometheus_interval_s": args.prometheus_interval,
                "scrape_interval_s": args.scrape_interval, "tolerance": args.tolerance, "slo_goal": args.slo_goal / 100,
                "families": plan.families, "best": best}
        write_outputs(Path(args.output), body, check, results, plan.targets, plan.skipped)
    return 0 if check.passed else 1


@dataclass
class _Plan:
    policies: list[Policy] = field(default_factory=list)
    targets: dict[str, str] = field(default_factory=dict)  # policy -> its target, described
    skipped: dict[str, str] = field(default_factory=dict)  # policy -> why it was not simulated
    families: dict[str, str] = field(default_factory=dict)  # policy -> the policy it is a setting of
    target_rates: dict[str, float] = field(default_factory=dict)  # headroom -> requests/s per replica

    def add(self, family: str, policy: Policy, target: str) -> None:
        self.policies.append(policy)
        self.families[policy.name] = family
        self.targets[policy.name] = target


def _plan(args: argparse.Namespace, curve: CapacityCurve, trace: Trace, slo_rate: float) -> _Plan:
    plan = _Plan()
    static = max(1, math.ceil(trace.peak / slo_rate))
    max_replicas = args.max_replicas or 2 * static
    builtin = Pipeline(args.scrape_interval, "mean")
    plan.add("static-peak", Policy("static-peak", None, builtin, static),
             f"{static} replicas ({trace.peak:.1f} req/s / {slo_rate:.2f} per replica)")
    headrooms = sorted(set(args.headroom), reverse=True)
    for headroom in headrooms:
        target_rate = headroom * slo_rate
        plan.target_rates[f"{headroom:g}"] = target_rate
        initial = min(max_replicas, max(1, math.ceil(float(trace.rates[0]) / target_rate)))
        suffix = f" h{headroom:g}" if len(headrooms) > 1 else ""
        targets = {}
        for metric, gauge in _SIGNALS.items():
            if gauge is not None and gauge not in curve.gauges:
                plan.skipped[f"builtin-{metric}"] = f"the curve carries no {gauge}"
                continue
            value = curve.percentiles("ttft", target_rate)[2] if gauge is None else curve.gauge(gauge, target_rate)
            if value <= 0:
                plan.skipped[f"builtin-{metric}{suffix}"] = (f"{metric} is 0 on the curve at {target_rate:.2f} req/s "
                                                             f"per replica: no target to hold")
                continue
            targets[metric] = value
        if args.hpa_target is None or headroom == headrooms[0]:  # a fixed target does not follow the headroom
            name = "hpa-queue" + (suffix if args.hpa_target is None else "")
            if args.hpa_target is not None or "waitingPerReplica" in targets:
                target = args.hpa_target or targets["waitingPerReplica"]
                spec = ScalingSpec(enabled=True, mode="hpa", metric="waitingPerReplica", target=target,
                                   max_replicas=max_replicas, tolerance=args.tolerance)
                plan.add("hpa-queue", Policy(name, spec, Pipeline(args.prometheus_interval, "latest"),
                                                       initial), f"waiting {target:.3g} per pod")
            else:
                plan.skipped[name] = plan.skipped.get(f"builtin-waitingPerReplica{suffix}",
                                                      plan.skipped.get("builtin-waitingPerReplica", ""))
        for metric, target in targets.items():
            _builtin(plan, f"builtin-{metric}", suffix, metric, target, max_replicas, builtin, initial, args.tolerance)
        # The spec gives the yardsticks the policies' behavior, bounds and interval; its metric is unused.
        spec = ScalingSpec(enabled=True, max_replicas=max_replicas)
        for family, seconds in (("reactive-bound", 0.0), ("clairvoyant", args.startup_delay + spec.interval)):
            plan.add(family, Policy(family + suffix, spec, builtin, initial, Foresight(seconds, target_rate)),
                     f"the trace's rate{f' {seconds:g} s ahead' if seconds else ''}, {target_rate:.3g} req/s "
                     f"per replica")
    if "kv_cache_usage" in curve.gauges:
        initial = min(max_replicas, max(1, math.ceil(float(trace.rates[0]) / (headrooms[0] * slo_rate))))
        _builtin(plan, f"builtin-kvCacheUsage@{ARTICLE_KV_TARGET:g}", "", "kvCacheUsage", ARTICLE_KV_TARGET,
                 max_replicas, builtin, initial, args.tolerance)
    return plan


def _builtin(plan: _Plan, family: str, suffix: str, metric: str, target: float, max_replicas: int,
             pipeline: Pipeline, initial: int, tolerance: float) -> None:
    spec = ScalingSpec(enabled=True, metric=metric, target=target, max_replicas=max_replicas,  # type: ignore[arg-type]
                       tolerance=tolerance)
    plan.add(family, Policy(family + suffix, spec, pipeline, initial), f"{metric} {target:.3g}")


def _trace(args: argparse.Namespace, slo_rate: float) -> Trace:
    if args.trace is not None:
        return load_trace(args.trace)
    if args.bursts < 0:
        raise ValueError(f"bursts: must be >= 0, not {args.bursts}")
    return day_trace(args.peak_rate or 8 * slo_rate, args.duration, bursts=args.bursts, seed=args.seed)

