"""`kvpilot bench autoscale`'s results: the table, the JSON and the PNG (matplotlib, Agg)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpilot.bench.fleet import FleetResult
from kvpilot.bench.self_check import SelfCheck

STATIC = "static-peak"


def rows(results: Sequence[FleetResult], targets: Mapping[str, str]) -> list[dict[str, Any]]:
    static = next((r for r in results if r.policy == STATIC), None)
    return [{
        "policy": r.policy, "target": targets.get(r.policy, ""), "slo_attainment": r.slo_attainment,
        "replica_hours": r.replica_hours,
        "replica_hours_vs_static": r.replica_hours / static.replica_hours if static and static.replica_hours else None,
        "num_requests": r.num_requests, "num_outside_slo": r.num_requests - r.num_met, "num_failed": r.num_failed,
        "num_scale_events": r.num_scale_events,
        "max_replicas": r.max_replicas,
    } for r in results]


def print_table(results: Sequence[FleetResult], targets: Mapping[str, str], skipped: Mapping[str, str]) -> None:
    table = rows(results, targets)
    width = max(len(r["policy"]) for r in table)
    print(f"{'policy':<{width}}  {'SLO met':>8}  {'outside':>9}  {'replica-h':>9}  {'vs static':>9}  "
          f"{'scalings':>8}  {'max':>4}  target")
    for r in table:
        ratio = "" if r["replica_hours_vs_static"] is None else f"{r['replica_hours_vs_static']:.1%}"
        print(f"{r['policy']:<{width}}  {r['slo_attainment']:>8.2%}  {r['num_outside_slo']:>9}  {r['replica_hours']:>9.1f}  "
              f"{ratio:>9}  {r['num_scale_events']:>8}  {r['max_replicas']:>4}  {r['target']}")
    for name, why in skipped.items():
        print(f"{name}: not simulated: {why}")


def best_settings(results: Sequence[FleetResult], families: Mapping[str, str], goal: float) -> dict[str, str]:
    """Each policy's best setting, by family: the fewest replica-hours among those with at least
    `goal` of requests within the SLO, else the highest share."""
    best: dict[str, FleetResult] = {}
    for r in results:
        family = families.get(r.policy, r.policy)
        held = best.get(family)
        if held is None or _better(r, held, goal):
            best[family] = r
    return {family: r.policy for family, r in best.items()}


def _better(r: FleetResult, than: FleetResult, goal: float) -> bool:
    if (r.slo_attainment >= goal) != (than.slo_attainment >= goal):
        return r.slo_attainment >= goal
    if r.slo_attainment >= goal:
        return r.replica_hours < than.replica_hours
    return r.slo_attainment > than.slo_attainment


def print_best(results: Sequence[FleetResult], best: Mapping[str, str], goal: float) -> None:
    by_name = {r.policy: r for r in results}
    static = by_name.get(STATIC)
    print(f"\neach policy at its best (the fewest replica-hours with >= {goal:.0%} within the SLO, else the highest share):")
    width = max(len(f) for f in best)
    for family, name in best.items():
        r = by_name[name]
        ratio = f"{r.replica_hours / static.replica_hours:.1%}" if static and static.replica_hours else ""
        mark = "" if r.slo_attainment >= goal else f"  (none reached {goal:.0%})"
        print(f"{family:<{width}}  {r.slo_attainment:>8.2%}  {r.num_requests - r.num_met:>9}  {r.replica_hours:>9.1f}  "
              f"{ratio:>9}  {name}{mark}")


def write_outputs(path: Path, body: dict[str, Any], check: SelfCheck, results: Sequence[FleetResult],
                  targets: Mapping[str, str], skipped: Mapping[str, str]) -> None:
    body = {**body,
            "self_check": {"passed": check.passed, "max_error": check.max_error, "tolerance": check.tolerance,
                           "points": [{"request_rate": r.request_rate, "measured": r.measured,
                                       "simulated": r.simulated, "max_error": r.max_error} for r in check.rows]},
            "policies": rows(results, targets), "skipped": dict(skipped),
            "timeline": {r.policy: {"minute_end_s": [t[0] for t in r.timeline], "rate": [t[1] for t in r.timeline],
                                    "replicas": [t[2] for t in r.timeline], "ready": [t[3] for t in r.timeline],
                                    "slo_attainment": [t[4] for t in r.timeline]} for r in results}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1) + "\n")
    png = path.with_suffix(".png")
    best = set(body.get("best", {}).values())
    plot(png, check, results, body["curve"]["slo_rate_per_replica"],
         [r for r in results if r.policy in best] if best else list(results), body.get("families", {}),
         body.get("slo_goal", 0.99))
    print(f"wrote {path} and {png}")


def plot(path: Path, check: SelfCheck, results: Sequence[FleetResult], slo_rate: float,
         timelines: Sequence[FleetResult], families: Mapping[str, str], goal: float) -> None:
    """The replicas of each of `timelines` over the trace against the replicas the arrival rate
    needs at the SLO; the share of requests outside the SLO against replica-hours of every result,
    a line through each policy's settings (`families`); the self-check's TTFT, simulated against
    measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(15, 4 + 1.3 * len(timelines)), constrained_layout=True)
    grid = fig.add_gridspec(len(timelines) + 3, 2)
    needed = [t[1] / slo_rate for t in results[0].timeline]
    settings: dict[str, list[FleetResult]] = {}  # each policy's settings, one colour a policy
    for r in results:
        settings.setdefault(families.get(r.policy, r.policy), []).append(r)
    colour = {family: f"C{i % 10}" for i, family in enumerate(settings)}
    for i, r in enumerate(timelines):
        ax = fig.add_subplot(grid[i, :])
        hours = [t[0] / 3600 for t in r.timeline]
        ax.plot(hours, needed, color="0.6", linewidth=0.8, label="rate / SLO rate per replica")
        ax.step(hours, [t[2] for t in r.timeline], where="post", color=colour[families.get(r.policy, r.policy)],
                linewidth=1.0, label="replicas")
        ax.set_ylabel("replicas", fontsize=8)
        ax.set_title(f"{r.policy}: {r.slo_attainment:.2%} of requests met the SLO, {r.replica_hours:.0f} replica-hours",
                     fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
        if i == 0:
            ax.legend(fontsize=7, loc="upper left")
        if i == len(timelines) - 1:
            ax.set_xlabel("hours")
    ax = fig.add_subplot(grid[len(timelines):, 0])
    static = next((r for r in results if r.policy == STATIC), None)
    scale = 100 / static.replica_hours if static and static.replica_hours else 1.0
    # a log scale shows 99.9% against 99.999%; a setting that missed none sits at half a request
    floor = 0.5 / max(1, max(r.num_requests for r in results))
    for family, members in settings.items():
        members = sorted(members, key=lambda r: r.replica_hours)
        ax.plot([scale * r.replica_hours for r in members],
                [max(1 - r.slo_attainment, floor) for r in members], "o-", color=colour[family], markersize=4,
                linewidth=1.0, label=family)
    ax.axhline(1 - goal, color="red", linewidth=0.8, linestyle="--", label=f"{goal:.0%} within the SLO")
    ax.set_yscale("log")
    ax.set_xlabel(f"replica-hours, % of {STATIC}" if static else "replica-hours")
    ax.set_ylabel("share of requests outside the SLO")
    ax.set_title("cost against requests lost to the SLO (each policy's settings joined)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    ax = fig.add_subplot(grid[len(timelines):, 1])
    rates = [r.request_rate for r in check.rows]
    for key, style in (("ttft_p50", "o"), ("ttft_p99", "^")):
        line, = ax.plot(rates, [1e3 * r.measured[key] for r in check.rows], f"{style}-", label=f"{key} measured")
        ax.plot(rates, [1e3 * r.simulated[key] for r in check.rows], f"{style}--", color=line.get_color(),
                label=f"{key} simulated")
    ax.set_xlabel("requests/s offered to one replica")
    ax.set_ylabel("ms")
    ax.set_title(f"self-check: {'passed' if check.passed else 'FAILED'}, max error {check.max_error:.1%}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=80)
    plt.close(fig)
