"""`kvpilot bench autotune`'s results: per run and phase figures, the verdicts against the issue's
targets, the table, the JSON and the PNG (latency over time with the switches marked, goodput per
phase)."""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from .autotune_workload import Phase, phase_bounds
from .percentile import percentile
from .slo import Slo
from .summary import latency_stats

DEFAULT_NAME = "static b16 recompute"
PHASE_TOLERANCE = 0.05  # the autotuner should come within 5% of each phase's best static config


def build_body(args: argparse.Namespace, phases: tuple[Phase, ...], slo: Slo, spec: Any, runs: list[dict[str, Any]],
               timed: list[Any]) -> dict[str, Any]:
    bounds = phase_bounds(phases)
    duration = bounds[-1][1]
    out_runs = []
    for run in runs:
        plan, load = run["plan"], run["load"]
        per_phase = []
        for index, (start, end) in enumerate(bounds):
            mine = [r for t, r in zip(timed, load.results, strict=True) if t.phase == index]
            last = index == len(bounds) - 1
            per_phase.append({"phase": phases[index].name, **_figures(mine, slo, end - start),
                              **_counters(run["counters"], start, math.inf if last else end)})
        overall = {**_figures(load.results, slo, duration), **_counters(run["counters"], -math.inf, math.inf)}
        entry: dict[str, Any] = {
            "name": plan.name, "block_size": plan.block_size, "preemption_mode": plan.preemption_mode,
            "tuned": plan.tuned, "num_gpu_blocks": run["num_gpu_blocks"], "overall": overall, "phases": per_phase,
            "requests": [{"phase": t.phase, "sent_s": r.sent_s, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                          "error": r.error} for t, r in zip(timed, load.results, strict=True)],
        }
        tuner = run["tuner"]
        if tuner is not None:
            for figures, (start, end) in zip(per_phase, bounds, strict=True):
                figures.update(_tuner_in(tuner, start, end if figures is not per_phase[-1] else math.inf))
            entry["tuner"] = {"switches": tuner.switches, "num_switches": len(tuner.switches),
                              "pause_s": tuner.pause_s, "num_decisions": tuner.num_decisions,
                              "num_holds": tuner.num_holds, "scrape_failures": tuner.scrape_failures,
                              "admin_errors": tuner.admin_errors, "decisions": tuner.decisions}
        out_runs.append(entry)
    body = {
        "command": ["kvpilot", *sys.argv[1:]], "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "serve_args": args.serve_args, "kv_tokens": args.kv_tokens, "slo": slo.describe(), "seed": args.seed,
        "workload": [dataclasses.asdict(p) for p in phases], "num_requests": len(timed),
        "tuning_spec": _jsonable(dataclasses.asdict(spec)), "runs": out_runs,
    }
    body["outputs_vs_unswitched"] = _compare_outputs(runs)
    body["verdicts"] = _verdicts(out_runs, phases)
    return body


def _figures(results: list[Any], slo: Slo, seconds: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    good = sum(1 for r in results if slo.met_by(r))
    p99 = {k: (stats["p99"] if (stats := latency_stats(v)) else None) for k, v in (
        ("ttft_p99_s", [r.ttft_s for r in done]), ("itl_p99_s", [g for r in done for g in r.itls_s]),
        ("e2e_p99_s", [r.e2e_s for r in done]))}
    return {"num_requests": len(results), "completed": len(done), "failed": len(results) - len(done),
            "goodput": good / seconds, "slo_attainment": good / len(results) if results else None, **p99}


def _tuner_in(tuner: Any, start: float, end: float) -> dict[str, Any]:
    """What the tuner did within [start, end): its switches and their pauses, and the mean queue
    depth and preemption rate of the windows it decided on."""
    switches = [s for s in tuner.switches if start <= s["at_s"] < end]
    seen = [d["signals"] for d in tuner.decisions if start <= d["at_s"] < end and d["signals"]]
    return {"switches": len(switches), "switch_pause_s": sum(s["pause_s"] for s in switches),
            "queue_depth": sum(g["queue_depth"] for g in seen) / len(seen) if seen else None,
            "preemptions_per_s": sum(g["preemptions_per_s"] for g in seen) / len(seen) if seen else None}


def _counters(points: list[tuple[float, float, float]], start: float, end: float) -> dict[str, float]:
    """Counter increases between the last samples at or before `start` and `end`."""
    if not points:
        return {"preemptions": math.nan, "swap_bytes": math.nan}
    times = [p[0] for p in points]

    def at(t: float) -> tuple[float, float, float]:
        return points[max(bisect.bisect_right(times, t) - 1, 0)]

    a = points[0] if start == -math.inf else at(start)
    b = points[-1] if end == math.inf else at(end)
    return {"preemptions": b[1] - a[1], "swap_bytes": b[2] - a[2]}


def _compare_outputs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The autotuner's greedy texts against the unswitched default's, request by request."""
    base = next((r for r in runs if r["plan"].name == DEFAULT_NAME), None)
    tuned = next((r for r in runs if r["plan"].tuned), None)
    if base is None or tuned is None:
        return {"compared": 0, "note": f"no {DEFAULT_NAME} run to compare with"}
    pairs = [(a, b) for a, b in zip(base["load"].results, tuned["load"].results, strict=True) if a.ok and b.ok]
    differing = [i for i, (a, b) in enumerate(pairs) if a.text != b.text]
    return {"against": DEFAULT_NAME, "compared": len(pairs), "differing": len(differing),
            "lost": sum(1 for a, b in zip(base["load"].results, tuned["load"].results, strict=True) if a.ok and not b.ok)}


def _verdicts(runs: list[dict[str, Any]], phases: tuple[Phase, ...]) -> dict[str, Any]:
    static = [r for r in runs if not r["tuned"]]
    tuned = next((r for r in runs if r["tuned"]), None)
    if not static or tuned is None:
        return {}
    best = max(static, key=lambda r: r["overall"]["goodput"])
    verdicts: dict[str, Any] = {
        "best_static": best["name"], "best_static_goodput": best["overall"]["goodput"],
        "autotuner_goodput": tuned["overall"]["goodput"],
        "autotuner_at_least_best_static": tuned["overall"]["goodput"] >= best["overall"]["goodput"],
        "phases": [],
    }
    for i, phase in enumerate(phases):
        top = max(static, key=lambda r: r["phases"][i]["goodput"])
        theirs, mine = top["phases"][i]["goodput"], tuned["phases"][i]["goodput"]
        verdicts["phases"].append({"phase": phase.name, "best_static": top["name"], "best_static_goodput": theirs,
                                   "autotuner_goodput": mine,
                                   "within_5_percent": mine >= (1 - PHASE_TOLERANCE) * theirs})
    default = next((r for r in static if r["name"] == DEFAULT_NAME), None)
    if default is not None and default["overall"]["ttft_p99_s"] and tuned["overall"]["ttft_p99_s"] is not None:
        verdicts["ttft_p99_vs_default"] = tuned["overall"]["ttft_p99_s"] / default["overall"]["ttft_p99_s"] - 1
        if default["overall"]["e2e_p99_s"] and tuned["overall"]["e2e_p99_s"] is not None:
            verdicts["e2e_p99_vs_default"] = tuned["overall"]["e2e_p99_s"] / default["overall"]["e2e_p99_s"] - 1
        verdicts["article_claim"] = "P99 latency -40%"
    return verdicts


def print_table(body: dict[str, Any]) -> None:
    phases = [p["name"] for p in body["workload"]]
    head = (f"{'configuration':<24}{'goodput/s':>10}{'SLO met':>9}{'TTFT P99':>10}{'E2E P99':>10}{'failed':>8}"
            f"{'preempt':>9}{'swap MB':>9}{'switches':>9}{'pause ms':>9}  " + "  ".join(f"{p[:10]:>10}" for p in phases))
    print(f"goodput under {body['slo']}; per-phase columns are goodput/s")
    print(head)
    for run in body["runs"]:
        o = run["overall"]
        tuner = run.get("tuner")
        print(f"{run['name']:<24}{o['goodput']:>10.3f}{_pct(o['slo_attainment']):>9}{_ms(o['ttft_p99_s']):>10}"
              f"{_ms(o['e2e_p99_s']):>10}{o['failed']:>8}{o['preemptions']:>9.0f}{o['swap_bytes'] / 1e6:>9.1f}"
              f"{(tuner['num_switches'] if tuner else 0):>9}{(1e3 * tuner['pause_s'] if tuner else 0):>9.1f}  "
              + "  ".join(f"{p['goodput']:>10.3f}" for p in run["phases"]))
    for run in body["runs"]:
        if run.get("tuner"):
            print("  " + "; ".join(f"{p['phase']}: {p['switches']} switches, pause {1e3 * p['switch_pause_s']:.0f} ms, "
                                   f"queue {_num(p['queue_depth'])}, preemptions {_num(p['preemptions_per_s'])}/s"
                                   for p in run["phases"]))
        for s in (run.get("tuner") or {}).get("switches", []):
            print(f"  switch at {s['at_s']:.1f} s: block {s['from']['block_size']} {s['from']['preemption_mode']} -> "
                  f"{s['to']['block_size']} {s['to']['preemption_mode']} (pause {1e3 * s['pause_s']:.1f} ms): {s['reason']}")
    v = body["verdicts"]
    if v:
        print(f"autotuner goodput {v['autotuner_goodput']:.3f}/s vs best static ({v['best_static']}) "
              f"{v['best_static_goodput']:.3f}/s: {'>=' if v['autotuner_at_least_best_static'] else 'below'}")
        for p in v["phases"]:
            print(f"  {p['phase']}: autotuner {p['autotuner_goodput']:.3f}/s vs {p['best_static']} "
                  f"{p['best_static_goodput']:.3f}/s: {'within 5%' if p['within_5_percent'] else 'more than 5% below'}")
        if "ttft_p99_vs_default" in v:
            print(f"P99 TTFT vs {DEFAULT_NAME}: {v['ttft_p99_vs_default']:+.0%}"
                  + (f", P99 E2E {v['e2e_p99_vs_default']:+.0%}" if "e2e_p99_vs_default" in v else "")
                  + " (the article claims -40%)")
    c = body["outputs_vs_unswitched"]
    if c.get("compared"):
        print(f"greedy outputs vs {c['against']}: {c['differing']} of {c['compared']} differ; "
              f"{c['lost']} lost by the autotuned run")


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1e3 * seconds:.0f}ms"


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_outputs(path: Path, body: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(body), indent=2) + "\n")
    _plot(body, path.with_suffix(".png"))


def _plot(body: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (lat, bars) = plt.subplots(2, 1, figsize=(12, 8), gridspec_kw={"height_ratios": [3, 2]})
    start = 0.0
    for i, phase in enumerate(body["workload"]):
        lat.axvspan(start, start + phase["duration"], color=("#f2f2f2" if i % 2 else "#e6eef7"), zorder=0)
        lat.text(start + 1, 1.0, phase["name"], transform=lat.get_xaxis_transform(), va="top", fontsize=8)
        start += phase["duration"]
    for run in body["runs"]:
        points = sorted((r["sent_s"], r["ttft_s"]) for r in run["requests"] if r["ttft_s"] is not None)
        if not points:
            continue
        xs, ys = np.array([p[0] for p in points]), np.array([p[1] for p in points])
        window = max(1, len(xs) // 40)
        rolling = [percentile(ys[max(0, j - window):j + 1], 99) for j in range(len(ys))]
        style = {"linewidth": 2.2, "color": "black"} if run["tuned"] else {"linewidth": 1, "alpha": 0.8}
        lat.plot(xs, [1e3 * v for v in rolling], label=run["name"], **style)
        for s in (run.get("tuner") or {}).get("switches", []):
            lat.axvline(s["at_s"], color="red", linestyle="--", linewidth=1)
            lat.text(s["at_s"], 0.02, f" b{s['to']['block_size']} {s['to']['preemption_mode']}", color="red",
                     transform=lat.get_xaxis_transform(), rotation=90, fontsize=7, va="bottom")
    lat.set_yscale("log")
    lat.set_xlabel("request sent at (s)")
    lat.set_ylabel("TTFT, rolling P99 (ms)")
    lat.set_title(f"latency over time; autotuner switches in red (KV budget {body['kv_tokens']} tokens)", fontsize=10)
    lat.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    lat.grid(True, which="both", alpha=0.3)
    names = [p["name"] for p in body["workload"]] + ["overall"]
    width = 0.8 / max(1, len(body["runs"]))
    for k, run in enumerate(body["runs"]):
        values = [p["goodput"] for p in run["phases"]] + [run["overall"]["goodput"]]
        bars.bar(np.arange(len(names)) + k * width, values, width, label=run["name"],
                 color="black" if run["tuned"] else None)
    bars.set_xticks(np.arange(len(names)) + width * (len(body["runs"]) - 1) / 2, names)
    bars.set_ylabel(f"goodput (req/s, {body['slo']})")
    bars.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
