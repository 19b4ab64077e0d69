"""`kvpilot bench autoscale`: how the autoscaling modes would serve days of traffic, in a
simulation of the fleet fed by one replica's measured capacity curve.

Each mode on each signal (`autoscale_plan.py`), at each setting of the grid (`--headroom`,
`--tolerance`, `--forecast-horizon`), beside a static fleet for the peak and two yardsticks, on
the days of `--seed` (each a built-in day with its own bursts and arrivals, or `--trace` with its
own arrivals), their requests and replica-hours pooled. Every fleet of a day is offered the very
same requests. With `--choose-on`, each family's setting is chosen on those days (the cheapest
with at least `--slo-goal` of requests within the SLO, else the highest share) and judged on the
`--seed` days, so a setting is never judged on the day it was picked on.

Before the comparison the simulator checks itself: one simulated replica, offered each rate of
the curve, must reproduce the curve's P50/P90/P99 TTFT, ITL and E2E (in a long steady run) and its
throughput (in the same finite run bench serve made, `self_check.py`) within 10%; when it does
not, the results are still shown and the command exits with 1. A curve whose runs hold fewer
than `SUSTAINED_REQUESTS` requests a rate is said to be short. Results: tables, and with
`--output FILE` JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from pathlib import Path

from kvpilot.bench.arrival_trace import DAY_S, Trace, TraceError, day_trace, load_trace
from kvpilot.bench.autoscale_modes import Cluster
from kvpilot.bench.autoscale_plan import MODES, SIGNALS, Plan, Settings, plan
from kvpilot.bench.capacity_curve import CapacityCurve, CurveError, load_curve
from kvpilot.bench.flags import (
    fraction,
    non_negative_int,
    percent,
    positive_float,
    positive_int,
    tolerance,
)
from kvpilot.bench.fleet import FleetResult, simulate
from kvpilot.bench.fleet_inputs import SimConfig
from kvpilot.bench.self_check import self_check
from kvpilot.operator.autoscale.scaling_spec import (
    DEFAULT_INTERVAL_S,
    DEFAULT_LOOKBACK_S,
    DEFAULT_WINDOW_S,
)

SUSTAINED_REQUESTS = 1000  # a rate's run shorter than this is a transient, not a steady state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("inputs")
    g.add_argument("--capacity-curve", required=True, metavar="FILE", type=Path,
                   help="one replica's measured curve: kvpilot bench serve --output, or points as "
                        "bench/capacity_curve.py documents")
    g.add_argument("--trace", default=None, metavar="FILE", type=Path,
                   help="arrival rate over time, CSV time_s,rate or JSON (default: a built-in day with bursts)")
    g.add_argument("--peak-rate", type=positive_float, default=None, metavar="REQ/S",
                   help="built-in trace: the day's peak before bursts (default: 8 replicas' worth at the SLO)")
    g.add_argument("--duration", type=positive_float, default=DAY_S, metavar="SECONDS",
                   help="built-in trace: the day squeezed into this long")
    g.add_argument("--bursts", type=non_negative_int, default=8, help="built-in trace: bursts in the day")
    g.add_argument("--write-trace", default=None, metavar="FILE", type=Path,
                   help="write the first day simulated as CSV (time_s,rate), which --trace reads back")
    g = parser.add_argument_group("SLO")
    g.add_argument("--slo-ttft-ms", type=positive_float, default=1000.0, help="a request meets the SLO within this TTFT")
    g.add_argument("--slo-e2e-ms", type=positive_float, default=None, help="...and, when given, within this E2E")
    g.add_argument("--slo-goal", type=percent, default=99.9, metavar="PERCENT",
                   help="the share of requests within the SLO a setting must reach to count as its family's best")
    g = parser.add_argument_group("fleets and settings")
    g.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the modes simulated")
    g.add_argument("--signals", nargs="+", choices=list(SIGNALS), default=["kvCacheUsage", "waitingPerReplica"],
                   help="the signals each mode scales on (hpa and keda: kvCacheUsage and waitingPerReplica)")
    g.add_argument("--headroom", type=fraction, nargs="+", default=[0.6], metavar="SHARE",
                   help="targets are the signals' values at this share of the highest rate meeting the SLO")
    g.add_argument("--tolerance", type=tolerance, nargs="+", default=[0.1], metavar="SHARE",
                   help="a ratio to the target within it changes nothing (the HPA's default 0.1)")
    g.add_argument("--forecast-horizon", type=_horizon, nargs="+", default=[None], metavar="SECONDS|auto",
                   help="builtin's forecast horizon; auto: the start-up delay plus one interval")
    g.add_argument("--forecast-lookback", type=positive_float, default=DEFAULT_LOOKBACK_S, metavar="SECONDS")
    g.add_argument("--max-replicas", type=positive_int, default=None, help="maxReplicas (default: 2x the static fleet)")
    g = parser.add_argument_group("cluster")
    g.add_argument("--startup-delay", type=positive_float, default=120.0, metavar="SECONDS",
                   help="a new replica's creation to Ready: the pod's scheduling and start plus kvpilot's")
    g.add_argument("--pending", type=float, default=5.0, metavar="SECONDS",
                   help="the first part of the start-up, Pending (an HPA counts the pod unready, not missing)")
    g.add_argument("--interval", type=positive_float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                   help="builtin's interval (it scrapes every pod and decides this often)")
    g.add_argument("--window", type=positive_float, default=DEFAULT_WINDOW_S, metavar="SECONDS",
                   help="builtin's and keda's window")
    g.add_argument("--prometheus-interval", type=positive_float, default=Cluster.prometheus_interval_s, metavar="SECONDS",
                   help="Prometheus's scrapes of the engines (the chart's engineMonitoring.interval)")
    g.add_argument("--adapter-window", type=positive_float, default=Cluster.adapter_window_s, metavar="SECONDS",
                   help="prometheus-adapter's range (the chart's prometheusAdapterRules.window)")
    g.add_argument("--hpa-sync", type=positive_float, default=Cluster.hpa_sync_s, metavar="SECONDS",
                   help="the HPA controller's sync period")
    g.add_argument("--request-timeout", type=positive_float, default=60.0, metavar="SECONDS",
                   help="clients give up on a request queued this long")
    g = parser.add_argument_group("simulation")
    g.add_argument("--tick", type=positive_float, default=1.0, metavar="SECONDS")
    g.add_argument("--seed", type=int, nargs="+", default=[0], metavar="N",
                   help="the days simulated (the built-in day's bursts and every day's arrivals); pooled")
    g.add_argument("--choose-on", type=int, nargs="+", default=None, metavar="N",
                   help="days on which each family's setting is chosen, to be judged on the --seed days")
    g.add_argument("--jobs", type=positive_int, default=1, help="simulations run at once (processes)")
    g.add_argument("--self-check-requests", type=int, default=20_000,
                   help="requests per curve point in the simulator's self-check")
    g.add_argument("--output", default=None, metavar="FILE", help="write JSON here and a PNG beside it")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        curve = load_curve(args.capacity_curve)
        cluster = Cluster(args.prometheus_interval, min(args.prometheus_interval / 2, 7.0), args.adapter_window,
                          args.hpa_sync)
        config = SimConfig(tick_s=args.tick, startup_s=args.startup_delay, pending_s=args.pending,
                           slo_ttft_s=args.slo_ttft_ms / 1000, request_timeout_s=args.request_timeout,
                           slo_e2e_s=None if args.slo_e2e_ms is None else args.slo_e2e_ms / 1000, cluster=cluster)
        slo_rate = curve.highest_rate_within(config.slo_ttft_s, config.slo_e2e_s)
        if slo_rate is None:
            raise ValueError(f"slo: even the curve's lowest rate ({curve.points[0].request_rate:g} req/s) misses "
                             f"P99 TTFT {args.slo_ttft_ms:g} ms; no fleet can meet it")
        grid = Settings(tuple(sorted(set(args.headroom), reverse=True)), tuple(sorted(set(args.tolerance))),
                        tuple(dict.fromkeys(args.forecast_horizon)), args.forecast_lookback, args.interval,
                        args.window, args.max_replicas)
        days = {seed: _trace(args, slo_rate, seed) for seed in dict.fromkeys([*(args.choose_on or []), *args.seed])}
        if args.write_trace is not None:
            days[args.seed[0]].write_csv(args.write_trace)
        plans = {seed: plan(curve, trace, slo_rate, config, args.modes, args.signals, grid)
                 for seed, trace in days.items()}
        check = self_check(curve, config, args.self_check_requests)
    except (CurveError, TraceError, ValueError, OSError) as e:
        print(f"kvpilot bench autoscale: error: {e}", file=sys.stderr)
        return 2
    from kvpilot.bench.autoscale_report import Pooled, report

    print(check.describe())
    if short := _short_runs(curve):
        print(short)
    results = _simulate(curve, days, plans, config, args)
    judged = Pooled.of(results, plans, args.seed)
    chosen_on = Pooled.of(results, plans, args.choose_on) if args.choose_on else None
    body = {"command": ["kvpilot", *sys.argv[1:]], "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "curve": {"file": str(args.capacity_curve), "description": curve.description, "capacity": curve.capacity,
                      "slo_rate_per_replica": slo_rate, "short_runs": short or None},
            "days": {str(seed): {"description": t.description, "duration_s": t.duration_s, "peak": t.peak}
                     for seed, t in days.items()},
            "config": {"startup_s": config.startup_s, "pending_s": config.pending_s, "slo_ttft_s": config.slo_ttft_s,
                       "slo_e2e_s": config.slo_e2e_s, "request_timeout_s": config.request_timeout_s,
                       "interval_s": args.interval, "window_s": args.window, "cluster": asdict(cluster)},
            "slo_goal": args.slo_goal / 100, "seeds": args.seed, "choose_on": args.choose_on}
    report(body, check, judged, chosen_on, args.slo_goal / 100, Path(args.output) if args.output else None)
    return 0 if check.passed else 1


def _simulate(curve: CapacityCurve, days: dict[int, Trace], plans: dict[int, Plan], config: SimConfig,
              args: argparse.Namespace) -> dict[tuple[int, str], FleetResult]:
    from tqdm import tqdm

    jobs = [(seed, policy) for seed, p in plans.items() for policy in p.policies]
    ticks = [math.ceil(days[seed].duration_s / config.tick_s) for seed, _ in jobs]
    results: dict[tuple[int, str], FleetResult] = {}
    with tqdm(total=sum(ticks), unit="tick", disable=args.disable_tqdm, file=sys.stderr) as bar:
        if args.jobs == 1:
            for (seed, policy), n in zip(jobs, ticks, strict=True):
                bar.set_description(f"day {seed}: {policy.name}")
                results[seed, policy.name] = simulate(curve, days[seed], policy, replace(config, seed=seed))
                bar.update(n)
            return results
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = {pool.submit(simulate, curve, days[seed], policy, replace(config, seed=seed)): (seed, policy, n)
                       for (seed, policy), n in zip(jobs, ticks, strict=True)}
            for future in as_completed(futures):
                seed, policy, n = futures[future]
                results[seed, policy.name] = future.result()
                bar.update(n)
    return results


def _short_runs(curve: CapacityCurve) -> str:
    counts = [p.num_requests for p in curve.points if p.num_requests is not None]
    if counts and min(counts) < SUSTAINED_REQUESTS:
        return (f"note: the curve's runs hold {min(counts)}-{max(counts)} requests a rate, fewer than the "
                f"{SUSTAINED_REQUESTS:,} of a sustained run: re-measure with kvpilot bench serve --num-prompts "
                f"{SUSTAINED_REQUESTS}")
    return ""


def _trace(args: argparse.Namespace, slo_rate: float, seed: int) -> Trace:
    if args.trace is not None:
        return load_trace(args.trace)
    return day_trace(args.peak_rate or 8 * slo_rate, args.duration, bursts=args.bursts, seed=seed)


def _horizon(text: str) -> float | None:
    return None if text == "auto" else positive_float(text)
