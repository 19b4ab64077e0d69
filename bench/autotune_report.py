"""`kvpilot bench autotune`'s results: per run and phase figures, the verdicts against the issue's
targets, the table, the JSON and the PNG (latency over time with the switches marked, goodput per
phase)."""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path
from statistics import fmean
from typing import Any

from .autotune_workload import Phase, phase_bounds
from .percentile import percentile
from .slo import Slo
from .summary import latency_stats

PHASE_TOLERANCE = 0.05  # the autotuner should come within 5% of each phase's best static config
TTFT_TARGET = 0.7  # its P99 TTFT at most this share of the unswitched default's


def build_body(args: argparse.Namespace, phases: tuple[Phase, ...], slo: Slo, spec: Any, runs: list[dict[str, Any]],
               timed: list[Any], baseline: str | None) -> dict[str, Any]:
    """`baseline`: the static run the autotuner's outputs and P99 TTFT are compared with."""
    bounds = phase_bounds(phases)
    duration = bounds[-1][1]
    out_runs = []
    for run in runs:
        plan, load = run["plan"], run["load"]
        per_phase = []
        for index, (start, end) in enumerate(bounds):
            mine = [r for t, r in zip(timed, load.results, strict=True) if t.phase == index]
            last = index == len(bounds) - 1
            # screening sends each phase once the one before has drained: the counters' clock is not the workload's
            counters = {} if args.screen is not None else _counters(run["counters"], start, math.inf if last else end)
            per_phase.append({"phase": phases[index].name, **_figures(mine, slo, end - start), **counters})
        overall = {**_figures(load.results, slo, duration), **_counters(run["counters"], -math.inf, math.inf)}
        entry: dict[str, Any] = {
            "name": plan.name, "config": plan.config, "repeat": plan.repeat, **dataclasses.asdict(plan.knobs),
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
                              "admin_errors": tuner.admin_errors, "decisions": tuner.decisions,
                              "records": tuner.records, "events": tuner.events}
        out_runs.append(entry)
    body = {
        "command": ["kvpilot", *sys.argv[1:]], "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "serve_args": args.serve_args, "kv_tokens": args.kv_tokens, "slo": slo.describe(), "seed": args.seed,
        "screen_s": args.screen, "baseline": baseline,
        "workload": [dataclasses.asdict(p) for p in phases], "num_requests": len(timed),
        "tuning_spec": _jsonable(dataclasses.asdict(spec)), "runs": out_runs,
    }
    body["outputs_vs_unswitched"] = _compare_outputs(runs, baseline)
    body["verdicts"] = _verdicts(out_runs, phases, baseline)
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


def _compare_outputs(runs: list[dict[str, Any]], baseline: str | None) -> dict[str, Any]:
    """Every autotuner run's greedy texts against the unswitched default's (its first run), request
    by request."""
    base = next((r for r in runs if r["plan"].config == baseline), None)
    tuned = [r for r in runs if r["plan"].tuned]
    if base is None or not tuned:
        return {"compared": 0, "note": "no unswitched default (16/recompute) run to compare with"}
    compared = differing = lost = 0
    for run in tuned:
        both = list(zip(base["load"].results, run["load"].results, strict=True))
        pairs = [(a, b) for a, b in both if a.ok and b.ok]
        compared += len(pairs)
        differing += sum(1 for a, b in pairs if a.text != b.text)
        lost += sum(1 for a, b in both if a.ok and not b.ok)
    return {"against": base["plan"].name, "runs": len(tuned), "compared": compared, "differing": differing, "lost": lost}


def _spread(values: list[float | None]) -> dict[str, float] | None:
    """Mean, min and max of the values there are; None without any."""
    known = [v for v in values if v is not None]
    return {"mean": fmean(known), "min": min(known), "max": max(known)} if known else None


def _by_config(runs: list[dict[str, Any]], phases: tuple[Phase, ...]) -> dict[str, dict[str, Any]]:
    """Each configuration's runs (its repeats) and the spread of their figures, in run order."""
    names = list(dict.fromkeys(r["config"] for r in runs))
    out = {}
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        out[name] = {
            "config": name, "tuned": mine[0]["tuned"], "runs": len(mine),
            "goodput": _spread([r["overall"]["goodput"] for r in mine]),
            "ttft_p99_s": _spread([r["overall"]["ttft_p99_s"] for r in mine]),
            "phases": [{"phase": p.name, "goodput": _spread([r["phases"][i]["goodput"] for r in mine])}
                       for i, p in enumerate(phases)]}
    return out


def _phase_mean(index: int, config: dict[str, Any]) -> float:
    return float(config["phases"][index]["goodput"]["mean"])


def _verdicts(runs: list[dict[str, Any]], phases: tuple[Phase, ...], baseline: str | None) -> dict[str, Any]:
    """The issue's targets, on each configuration's mean over its repeats. The *oracle* is the best
    static configuration of each phase, switched to instantly at the phase's start: its goodput is
    the phases' best goodputs weighted by their durations. The autotuner's goodput should reach the
    best single static configuration's plus half of the oracle's gain over it, come within 5% of
    the oracle in every phase, and keep P99 TTFT at most 0.7 of the unswitched default's; each
    autotuner run is judged, and every configuration's spread given (`spread`)."""
    configs = _by_config(runs, phases)
    static = [c for c in configs.values() if not c["tuned"]]
    tuned = [r for r in runs if r["tuned"]]
    if not static:
        return {}
    total = sum(p.duration for p in phases)
    best = max(static, key=lambda c: c["goodput"]["mean"])
    per_phase = [max(static, key=functools.partial(_phase_mean, i)) for i in range(len(phases))]
    phase_best = [top["phases"][i]["goodput"]["mean"] for i, top in enumerate(per_phase)]
    oracle = sum(g * p.duration for g, p in zip(phase_best, phases, strict=True)) / total
    best_goodput = best["goodput"]["mean"]
    gain = oracle - best_goodput
    verdicts: dict[str, Any] = {
        "best_static": best["config"], "best_static_goodput": best_goodput,
        "phase_best": [{"phase": p.name, "config": top["config"], "goodput": g}
                       for top, p, g in zip(per_phase, phases, phase_best, strict=True)],
        "oracle_goodput": oracle, "oracle_gain": gain,
        "oracle_gain_ratio": gain / best_goodput if best_goodput else None,
        "optima_differ": len({top["config"] for top in per_phase}) > 1,
        "spread": list(configs.values()),
    }
    if not tuned:
        return verdicts
    default = configs.get(baseline) if baseline is not None else None
    default_ttft = (default["ttft_p99_s"] or {}).get("mean") if default is not None else None
    target = best_goodput + gain / 2
    judged = []
    for run in tuned:
        mine = {"run": run["name"], "goodput": run["overall"]["goodput"],
                "meets_goodput_target": run["overall"]["goodput"] >= target,
                "phases": [{"phase": p.name, "goodput": run["phases"][i]["goodput"],
                            "within_5_percent_of_oracle": run["phases"][i]["goodput"] >= (1 - PHASE_TOLERANCE) * g}
                           for i, (p, g) in enumerate(zip(phases, phase_best, strict=True))]}
        if default_ttft and run["overall"]["ttft_p99_s"] is not None:
            mine["ttft_p99_vs_default"] = run["overall"]["ttft_p99_s"] / default_ttft
            mine["meets_ttft_target"] = mine["ttft_p99_vs_default"] <= TTFT_TARGET
        judged.append(mine)
    goodputs = [r["goodput"] for r in judged]
    verdicts.update({
        "goodput_target": target, "autotuner": judged,
        "autotuner_goodput": _spread(goodputs),
        "autotuner_at_least_best_static": min(goodputs) >= best_goodput,
    })
    return verdicts


def print_table(body: dict[str, Any]) -> None:
    phases = [p["name"] for p in body["workload"]]
    head = (f"{'configuration':<32}{'goodput/s':>10}{'SLO met':>9}{'TTFT P99':>10}{'E2E P99':>10}{'failed':>8}"
            f"{'preempt':>9}{'swap MB':>9}{'switches':>9}{'pause ms':>9}  " + "  ".join(f"{p[:10]:>10}" for p in phases))
    print(f"goodput under {body['slo']}; per-phase columns are goodput/s")
    print(head)
    for run in body["runs"]:
        o = run["overall"]
        tuner = run.get("tuner")
        print(f"{run['name']:<32}{o['goodput']:>10.3f}{_pct(o['slo_attainment']):>9}{_ms(o['ttft_p99_s']):>10}"
              f"{_ms(o['e2e_p99_s']):>10}{o['failed']:>8}{o['preemptions']:>9.0f}{o['swap_bytes'] / 1e6:>9.1f}"
              f"{(tuner['num_switches'] if tuner else 0):>9}{(1e3 * tuner['pause_s'] if tuner else 0):>9.1f}  "
              + "  ".join(f"{p['goodput']:>10.3f}" for p in run["phases"]))
    for run in body["runs"]:
        if run.get("tuner"):
            print("  " + "; ".join(f"{p['phase']}: {p['switches']} switches, pause {1e3 * p['switch_pause_s']:.0f} ms, "
                                   f"queue {_num(p['queue_depth'])}, preemptions {_num(p['preemptions_per_s'])}/s"
                                   for p in run["phases"]))
        for s in (run.get("tuner") or {}).get("switches", []):
            print(f"  switch at {s['at_s']:.1f} s ({s['action']}): {_knobs(s['from'])} -> {_knobs(s['to'])} "
                  f"(pause {1e3 * s['pause_s']:.1f} ms): {s['reason']}")
    v = body["verdicts"]
    if v:
        print(f"best single static: {v['best_static']} {v['best_static_goodput']:.3f}/s; oracle (each phase's best, "
              f"switched at once) {v['oracle_goodput']:.3f}/s, a gain of {v['oracle_gain']:+.3f}/s"
              + ("" if v["optima_differ"] else " (one configuration is best in every phase)"))
        for p in v["phase_best"]:
            print(f"  {p['phase']}: best {p['config']} {p['goodput']:.3f}/s")
    for run in (v or {}).get("autotuner", []):
        ttft = f", P99 TTFT {run['ttft_p99_vs_default']:.2f}x the default's" if "ttft_p99_vs_default" in run else ""
        print(f"{run['run']}: goodput {run['goodput']:.3f}/s vs target {v['goodput_target']:.3f}/s "
              f"({'met' if run['meets_goodput_target'] else 'missed'}){ttft}; within 5% of the oracle in "
              + ", ".join(f"{p['phase']} {'yes' if p['within_5_percent_of_oracle'] else 'no'}" for p in run["phases"]))
    repeated = [c for c in (v or {}).get("spread", []) if c["runs"] > 1]
    if repeated:
        print("over the repeats, mean [min, max]: goodput/s; P99 TTFT; goodput/s per phase")
    for c in repeated:
        print(f"  {c['config']} ({c['runs']} runs): {_range(c['goodput'], '{:.3f}')}; "
              f"{_range(c['ttft_p99_s'], '{:.0f}', 1e3)} ms; "
              + ", ".join(f"{p['phase']} {_range(p['goodput'], '{:.3f}')}" for p in c["phases"]))
    c = body["outputs_vs_unswitched"]
    if c.get("compared"):
        print(f"greedy outputs vs {c['against']}: {c['differing']} of {c['compared']} differ; "
              f"{c['lost']} lost by the autotuned runs")


def _knobs(config: dict[str, Any]) -> str:
    return (f"block {config['block_size']} {config['preemption_mode']}, max_num_seqs {config['max_num_seqs']}, "
            f"max_num_batched_tokens {config['max_num_batched_tokens']}")


def _range(spread: dict[str, float] | None, form: str, scale: float = 1.0) -> str:
    if spread is None:
        return "n/a"
    mean, low, high = (form.format(scale * spread[k]) for k in ("mean", "min", "max"))
    return f"{mean} [{low}, {high}]"


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
