"""`kvpilot bench autoscale`'s results: each fleet pooled over its days, each family's best
setting, the comparisons of cost against requests outside the SLO, the tables, the JSON and the
PNG (matplotlib, Agg).

A family's *frontier* is what it reaches at each cost: F(c), the highest share within the SLO
among its settings costing at most c replica-hours (a share of the static fleet's). One family's
frontier is at or above another's when, at the cost of each of the other's settings, it reaches
at least that setting's share. Prediction against the reactive bound is read at equal cost: the
bound's requests outside the SLO interpolated (log-linearly between its settings) at the cost of
the predictive setting.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpilot.bench.autoscale_plan import BOUND, SIGNALS, STATIC, Plan
from kvpilot.bench.fleet import FleetResult
from kvpilot.bench.self_check import SelfCheck


@dataclass(frozen=True)
class Row:
    """One fleet (a family at a setting) over a set of days."""

    name: str
    family: str
    setting: str
    target: str  # on the first day
    num_requests: int
    num_outside: int
    num_failed: int
    replica_hours: float
    static_hours: float  # the static fleet's over the same days
    num_scale_events: int
    max_replicas: int

    @property
    def attainment(self) -> float:
        return 1 - self.num_outside / self.num_requests if self.num_requests else 1.0

    @property
    def cost(self) -> float:
        return self.replica_hours / self.static_hours if self.static_hours else math.nan


@dataclass(frozen=True)
class Pooled:
    seeds: tuple[int, ...]
    rows: dict[str, Row]
    results: dict[tuple[int, str], FleetResult]

    @staticmethod
    def of(results: Mapping[tuple[int, str], FleetResult], plans: Mapping[int, Plan], seeds: Sequence[int]) -> Pooled:
        first = plans[seeds[0]]
        static = sum(results[seed, STATIC].replica_hours for seed in seeds)
        rows = {}
        for name in (p.name for p in first.policies):
            days = [results[seed, name] for seed in seeds]
            rows[name] = Row(name, first.families[name], first.settings[name], first.targets[name],
                             sum(r.num_requests for r in days), sum(r.num_requests - r.num_met for r in days),
                             sum(r.num_failed for r in days), sum(r.replica_hours for r in days), static,
                             sum(r.num_scale_events for r in days), max(r.max_replicas for r in days))
        return Pooled(tuple(seeds), rows, {k: v for k, v in results.items() if k[0] in seeds})

    def family(self, family: str) -> list[Row]:
        return sorted((r for r in self.rows.values() if r.family == family), key=lambda r: r.cost)

    def families(self) -> list[str]:
        return list(dict.fromkeys(r.family for r in self.rows.values()))

    def best(self, goal: float) -> dict[str, Row]:
        """Each family's cheapest setting with at least `goal` within the SLO, else its highest share."""
        out = {}
        for family in self.families():
            rows = self.family(family)
            meeting = [r for r in rows if r.attainment >= goal]
            out[family] = meeting[0] if meeting else max(rows, key=lambda r: r.attainment)
        return out


def reach(rows: Sequence[Row], cost: float) -> float | None:
    """F(cost): the highest share within the SLO among `rows` costing at most `cost`."""
    shares = [r.attainment for r in rows if r.cost <= cost + 1e-12]
    return max(shares) if shares else None


def frontier_gap(mine: Sequence[Row], theirs: Sequence[Row]) -> tuple[float, Row | None, list[Row]]:
    """The worst margin of `mine` over `theirs` (share within the SLO at the cost of each of their
    settings, mine less theirs) with the setting it falls at, over their settings at least as
    costly as mine's cheapest; and those cheaper than any of mine, which it cannot be judged at."""
    worst, at, cheaper = math.inf, None, []
    for row in theirs:
        mine_then = reach(mine, row.cost)
        if mine_then is None:
            cheaper.append(row)
        elif mine_then - row.attainment < worst:
            worst, at = mine_then - row.attainment, row
    return worst, at, cheaper


def outside_at(rows: Sequence[Row], cost: float) -> float | None:
    """The requests outside the SLO of a family at `cost`, log-linear between its two settings
    around it (None outside its costs); 0 outside counts as half a request."""
    points = sorted((r.cost, max(r.num_outside, 0.5)) for r in rows)
    for (c0, o0), (c1, o1) in zip(points, points[1:], strict=False):
        if c0 <= cost <= c1:
            share = 0.0 if c1 == c0 else (cost - c0) / (c1 - c0)
            return math.exp(math.log(o0) + share * (math.log(o1) - math.log(o0)))
    return None


def comparisons(pooled: Pooled, goal: float) -> list[dict[str, Any]]:
    """builtin's frontier against each other mode's on the same signal, and prediction against
    the reactive bound at the cost of builtin's best setting."""
    out: list[dict[str, Any]] = []
    best = pooled.best(goal)
    for signal in SIGNALS:
        mine = pooled.family(f"builtin:{signal}")
        if not mine:
            continue
        for other in ("hpa", "keda", "builtin-reactive"):
            theirs = pooled.family(f"{other}:{signal}")
            if theirs:
                margin, at, cheaper = frontier_gap(mine, theirs)
                out.append({"kind": "frontier", "mine": f"builtin:{signal}", "theirs": f"{other}:{signal}",
                            "holds": at is None or margin >= 0, "worst_margin": None if at is None else margin,
                            "at": None if at is None else at.setting,
                            "cheaper": [{"setting": r.setting, "cost": r.cost, "attainment": r.attainment}
                                        for r in cheaper]})
        bound = pooled.family(BOUND)
        chosen = best[f"builtin:{signal}"]
        expected = outside_at(bound, chosen.cost) if bound else None
        out.append({"kind": "prediction", "mine": chosen.name, "cost": chosen.cost, "outside": chosen.num_outside,
                    "bound_outside": expected,
                    "ratio": None if expected is None else expected / max(chosen.num_outside, 0.5)})
    return out


def print_rows(title: str, rows: Sequence[Row]) -> None:
    print(f"\n{title}")
    width = max(len(r.name) for r in rows)
    print(f"{'fleet':<{width}}  {'SLO met':>9}  {'outside':>9}  {'replica-h':>9}  {'vs static':>9}  {'scalings':>8}  "
          f"{'max':>4}  target")
    for r in rows:
        print(f"{r.name:<{width}}  {r.attainment:>9.3%}  {r.num_outside:>9}  {r.replica_hours:>9.1f}  {r.cost:>9.1%}  "
              f"{r.num_scale_events:>8}  {r.max_replicas:>4}  {r.target}")


def print_comparisons(items: Sequence[Mapping[str, Any]]) -> None:
    print()
    for c in items:
        if c["kind"] == "frontier":
            if c["holds"]:
                verdict = "at or above at every cost" + ("" if c["at"] is None else
                                                          f" (closest at {c['at']}: +{c['worst_margin']:.3%})")
            else:
                verdict = f"BELOW at {c['at']} (by {-c['worst_margin']:.3%})"
            if c["cheaper"]:
                verdict += (f"; not judged where {c['theirs']} is cheaper than any of its settings: "
                            + ", ".join(f"{r['setting']} ({r['cost']:.1%}, {r['attainment']:.3%})" for r in c["cheaper"]))
            print(f"{c['mine']} frontier vs {c['theirs']}: {verdict}")
        elif c["bound_outside"] is None:
            print(f"{c['mine']}: {c['outside']} outside the SLO at {c['cost']:.1%}; the reactive bound has no "
                  f"setting on both sides of that cost")
        else:
            print(f"{c['mine']}: {c['outside']} outside the SLO at {c['cost']:.1%}; the reactive bound at that cost "
                  f"{c['bound_outside']:.0f} ({c['ratio']:.1f}x)")


def report(body: dict[str, Any], check: SelfCheck, judged: Pooled, chosen_on: Pooled | None, goal: float,
           output: Path | None) -> None:
    print_rows(f"every fleet, days {', '.join(map(str, judged.seeds))} pooled:", list(judged.rows.values()))
    choice = (chosen_on or judged).best(goal)
    if chosen_on is not None:
        print(f"\neach family's setting chosen on days {', '.join(map(str, chosen_on.seeds))} (the cheapest with >= "
              f"{goal:.1%} within the SLO), judged on days {', '.join(map(str, judged.seeds))}:")
        for family, row in choice.items():
            j = judged.rows[row.name]
            print(f"{family:<30} {row.setting:<26} chosen {row.attainment:>8.3%} {row.cost:>7.1%}   judged "
                  f"{j.attainment:>8.3%} {j.cost:>7.1%} {j.num_outside:>8} outside")
    items = comparisons(judged, goal)
    print_comparisons(items)
    if output is None:
        return
    body = {**body, "self_check": {"passed": check.passed, "max_error": check.max_error, "tolerance": check.tolerance,
                                   "points": [asdict(r) for r in check.rows]},
            "judged": _rows(judged), "chosen_on": _rows(chosen_on) if chosen_on else None,
            "choice": {family: row.name for family, row in choice.items()}, "comparisons": items}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(body, indent=1) + "\n")
    png = output.with_suffix(".png")
    plot(png, check, judged, chosen_on, [row.name for row in choice.values()], goal,
         body["curve"]["slo_rate_per_replica"])
    print(f"wrote {output} and {png}")


def _rows(pooled: Pooled) -> dict[str, Any]:
    return {"seeds": list(pooled.seeds), "fleets": [{**asdict(r), "attainment": r.attainment, "cost": r.cost}
                                                    for r in pooled.rows.values()]}


def plot(path: Path, check: SelfCheck, judged: Pooled, chosen_on: Pooled | None, chosen: Sequence[str],
         goal: float, slo_rate: float) -> None:
    """The frontiers (requests outside the SLO against cost, each family's settings joined) on the
    judged days and the days the settings were chosen on; the chosen fleets' replicas over the
    first judged day; the self-check's TTFT, simulated against measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [n for n in chosen if judged.rows[n].family.startswith(("builtin:", "hpa:", "keda:", BOUND))][:4]
    fig = plt.figure(figsize=(15, 9 + 1.6 * len(shown)), constrained_layout=True)
    grid = fig.add_gridspec(2 + len(shown), 2, height_ratios=[4, 3] + [1.6] * len(shown))
    colour = {family: f"C{i % 10}" for i, family in enumerate(judged.families())}
    style = {"builtin": "o-", "builtin-reactive": "s--", "hpa": "^-", "keda": "v-"}
    for col, (pooled, label) in enumerate(((judged, "judged"), (chosen_on, "chosen on"))):
        if pooled is None:
            continue
        ax = fig.add_subplot(grid[0, col])
        floor = 0.5 / max(r.num_requests for r in pooled.rows.values())
        for family in pooled.families():
            if family == STATIC:
                continue
            rows = pooled.family(family)
            ax.plot([100 * r.cost for r in rows], [max(1 - r.attainment, floor) for r in rows],
                    style.get(family.split(":")[0], "x:"), color=colour[family], markersize=4, linewidth=1.0,
                    label=family)
        ax.axhline(1 - goal, color="red", linewidth=0.8, linestyle="--", label=f"{goal:.1%} within the SLO")
        ax.set_yscale("log")
        ax.set_xlabel(f"replica-hours, % of {STATIC}")
        ax.set_ylabel("share of requests outside the SLO")
        ax.set_title(f"{label}: days {', '.join(map(str, pooled.seeds))}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2)
    ax = fig.add_subplot(grid[1, :])
    rates = [r.request_rate for r in check.rows]
    for key, mark in (("ttft_p50", "o"), ("ttft_p99", "^")):
        line, = ax.plot(rates, [1e3 * r.measured[key] for r in check.rows], f"{mark}-", label=f"{key} measured")
        ax.plot(rates, [1e3 * r.simulated[key] for r in check.rows], f"{mark}--", color=line.get_color(),
                label=f"{key} simulated")
    ax.set_xlabel("requests/s offered to one replica")
    ax.set_ylabel("ms")
    ax.set_title(f"self-check: {'passed' if check.passed else 'FAILED'}, max error {check.max_error:.1%}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    day = judged.seeds[0]
    for i, name in enumerate(shown):
        r = judged.results[day, name]
        ax = fig.add_subplot(grid[2 + i, :])
        hours = [t[0] / 3600 for t in r.timeline]
        ax.plot(hours, [t[1] / slo_rate for t in r.timeline], color="0.6", linewidth=0.8, label="rate / SLO rate")
        ax.step(hours, [t[2] for t in r.timeline], where="post", color=colour[judged.rows[name].family],
                linewidth=1.0, label="replicas")
        ax.set_title(f"day {day}, {name}: {r.slo_attainment:.3%} within the SLO, {r.replica_hours:.0f} replica-hours",
                     fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7, loc="upper left")
    fig.savefig(path, dpi=80)
    plt.close(fig)
