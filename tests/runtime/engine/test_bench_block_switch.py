"""benchmarks/bench_block_switch.py's CPU path on a tiny dummy model: three live switches under
load, nothing recomputed, greedy outputs equal to the unswitched run, the JSON it writes with each
switch's pause breakdown; a switch after the last arrival is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_block_switch.py"


def test_block_switch_benchmark_runs_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "switch.json"
    subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny-llama", "--device", "cpu", "--requests", "10",
                    "--rate", "1000", "--prompt-len", "24", "--output-len", "48", "--switch-at", "0.002", "0.004", "0.006",
                    "--switch-to", "8", "64", "16", "--max-num-seqs", "8", "--output", str(out)],
                   check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    switches = result["switched"]["switches"]
    assert [(s["old_block_size"], s["new_block_size"]) for s in switches] == [(16, 8), (8, 64), (64, 16)]
    assert result["greedy_equal"] is True and result["recomputed"] == 0
    assert sum(s["num_running_kept"] for s in switches) > 0  # switches happened with requests in flight
    assert all(s["pause_ms"] >= 0 and s["bytes_moved"] >= 0 for s in switches)
    for s in switches:  # the pause's breakdown (docs/architecture.md), each part within it
        parts = [s[f] for f in ("plan_ms", "wait_ms", "copy_ms", "swap_ms", "rebuild_ms")]
        assert min(parts) >= 0 and sum(parts) <= s["pause_ms"]
    assert result["baseline"]["switches"] == [] and result["switched"]["ttft_ms"]["50"] is not None


def test_block_switch_benchmark_refuses_a_switch_after_the_arrivals() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny-llama", "--device", "cpu", "--requests", "10",
                           "--rate", "40", "--switch-at", "0.05", "1.0", "--switch-to", "8", "16"],
                          timeout=120, capture_output=True, text=True)
    assert done.returncode == 2 and "last arrival" in done.stderr
