"""`kvpilot bench startup` on a tiny checkpoint it writes itself: real `kvpilot serve` processes
timed to /ready with the page cache warm and cold, the engine's own phase record read back and
checked against the bench's clock, one request served, and bad input refused in one line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from kvpilot.bench import startup
from kvpilot.bench.random_checkpoint import tensor_shapes, write_checkpoint
from kvpilot.runtime.model_source import load_preset

# phases every `kvpilot serve` start records (runtime/startup.py), API process and engine core
API_PHASES = {"interpreter", "config", "server_imports", "tokenizer", "engine_core"}
CORE_PHASES = {"core_imports", "model_init", "weights", "cpu_pack", "kernel_select", "kv_profile", "kv_alloc",
               "swap_alloc", "eos_token_ids"}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpilot bench startup")
    startup.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_random_checkpoint_has_the_presets_tensors_and_is_written_once(tmp_path: Path) -> None:
    config = load_preset("tiny-llama")
    assert write_checkpoint(config, tmp_path)[0]
    names = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})  # noqa: SIM118
    assert names == dict(tensor_shapes(config))
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 512
    assert not write_checkpoint(config, tmp_path)[0]  # the stamp matches: nothing rewritten


def test_startup_is_timed_warm_and_cold_from_the_engines_own_record(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "startup.json"
    args = parse("--write-checkpoint", "tiny-llama", "--checkpoint-dir", str(tmp_path / "ckpt"), "--runs", "1",
                 "--cache", "warm", "cold", "--serve-args", "--max-model-len 256 --cpu-kv-cache-space 0.05",
                 "--wait-after-ready", "30", "--evict", "checkpoint", "--output", str(out))
    assert startup.run(args) == 0
    result = json.loads(out.read_text())
    size = result["checkpoint_bytes"]
    assert size == sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.safetensors"))
    assert result["disk"]["eviction"] == "fadvise" and result["disk"]["cold_gb_per_s"] >= 0
    assert [c["cache"] for c in result["conditions"]] == ["warm", "cold"]
    for condition in result["conditions"]:
        run = condition["runs"][0]
        phases = {(p["process"], p["name"]): p for p in run["phases"]}
        assert {n for p, n in phases if p == "api"} >= API_PHASES
        assert {n for p, n in phases if p == "core"} >= CORE_PHASES
        weights = phases["core", "weights"]
        assert weights["bytes"] == size and weights["reader"] == "safetensors"
        # one clock: the server's process started after the bench launched it, and every phase
        # lies between its start and the moment it answered /ready
        assert 0 < run["ready_s"] <= run["ready_wall_s"]
        starts = [p["start_s"] for p in run["phases"]]
        assert starts == sorted(starts) and starts[0] >= 0
        assert all(p["start_s"] + p["seconds"] <= run["ready_s"] + 1e-3 for p in run["phases"])
        # the core starts while the API process still imports the server
        assert phases["core", "core_imports"]["start_s"] < phases["api", "server_imports"]["start_s"] + \
            phases["api", "server_imports"]["seconds"]
        assert run["first_request_s"] > 0
        # CPU time, the load-independent cost: each phase's within its process's, the processes' in the total
        assert all(0 <= p["cpu_s"] for p in run["phases"])
        assert 0 < sum(p["cpu_s"] for p in run["phases"]) <= run["cpu_s"] + 0.1
        assert run["after_ready"] is not None and run["after_ready"]["units"] >= 1  # the switch pass
    printed = capsys.readouterr().out
    assert "core:weights" in printed and "process start -> Ready" in printed and "GB/s cold" in printed
    assert out.with_suffix(".png").stat().st_size > 0


def test_cold_start_without_a_checkpoint_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert startup.run(parse("--cache", "cold")) == 2
    assert "--cache cold needs a checkpoint folder" in capsys.readouterr().err
