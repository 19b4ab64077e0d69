"""`kvpilot bench serve --output`: the JSON file and the PNG beside it (latency percentiles and
goodput against the request rate)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def write_outputs(path: Path, body: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")
    plot(body, path.with_suffix(".png"))


def _x(run: dict[str, Any]) -> float:
    """The offered rate; for an unbounded run (rate inf) the rate it achieved."""
    rate = run["request_rate"]
    return run["request_throughput"] if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else rate


def plot(body: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((r for r in body["runs"] if r["completed"]), key=_x)
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [_x(r) for r in runs]
    for key, colour in (("ttft", "tab:blue"), ("itl", "tab:orange"), ("e2e", "tab:green")):
        for q, style in (("p50", "--"), ("p99", "-")):
            ys = [1000 * r[key][q] if r[key] else math.nan for r in runs]
            lat.plot(xs, ys, style, marker="o", color=colour, label=f"{key.upper()} {q.upper()}")
    lat.set_yscale("log")
    lat.set_xlabel("request rate (req/s; achieved where unbounded)")
    lat.set_ylabel("latency (ms)")
    lat.set_title("latency percentiles")
    lat.grid(True, which="both", alpha=0.3)
    lat.legend(fontsize=8)
    thr.plot(xs, [r["request_throughput"] for r in runs], marker="o", label="completed req/s")
    if runs and "goodput" in runs[0]:
        thr.plot(xs, [r["goodput"] for r in runs], marker="s", label=f"goodput ({runs[0]['slo']})")
    search = body.get("search")
    if search and search.get("highest_rate_meeting_slo"):
        thr.axvline(search["highest_rate_meeting_slo"], color="grey", linestyle=":", label="highest rate meeting SLO")
    thr.set_xlabel("request rate (req/s; achieved where unbounded)")
    thr.set_ylabel("requests/s")
    thr.set_title("throughput and goodput")
    thr.grid(True, alpha=0.3)
    thr.legend(fontsize=8)
    fig.suptitle(body.get("description", ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
