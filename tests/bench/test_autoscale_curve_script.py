"""benchmarks/autoscale_curve_gpu.py's verdict on the file bench serve writes: every request
answered with its tokens, and the simulator's self-check on the curve (the GPU run itself is the
script's; here its check reads the H200 curve measured before)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from file_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
CURVE = ROOT / "benchmarks" / "data" / "serve-curve-h200-async.json"


def test_the_check_passes_a_curve_whose_runs_all_answered(capsys: pytest.CaptureFixture[str]) -> None:
    verdict = load_script("autoscale_curve_gpu").check(CURVE, 300)
    assert verdict["lost"] == [] and verdict["self_check_passed"]
    printed = capsys.readouterr().out
    assert "every request answered with 256 tokens: yes" in printed and "self-check passed" in printed


def test_the_check_names_a_run_that_lost_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = json.loads(CURVE.read_text())
    body["runs"][2] |= {"completed": 299, "failed": 1, "errors": {"timeout": 1}}
    broken = tmp_path / "curve.json"
    broken.write_text(json.dumps(body))
    verdict = load_script("autoscale_curve_gpu").check(broken, 300)
    assert verdict["lost"] == [(24.0, 1, {"timeout": 1})]
    assert "every request answered with 256 tokens: NO" in capsys.readouterr().out
