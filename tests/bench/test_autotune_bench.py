"""`kvpilot bench autotune` on a tiny dummy model: real `kvpilot serve` processes, a burst that the
operator's policy answers with a live switch and the calm after it switched back, the switches'
pauses, per-phase figures, greedy outputs unchanged; and its input errors, one line each."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.bench import autotune
from kvpilot.bench.autotune_workload import QUICK, WorkloadFileError, build_requests, load_phases

KVPILOT = str(Path(sys.executable).parent / "kvpilot")
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}
# a burst far beyond what max_num_seqs 2 runs at once (some 3,900 steps for its ~7,700 tokens:
# seconds of queue even where a step takes half a millisecond, drained well inside the calm after
# it on a slow 2-core machine, where a step takes 2-3 ms), between two calm stretches
WORKLOAD = """\
phases:
  - {name: calm, duration: 3, rate: 1, input_len: 16, output_len: 8}
  - {name: burst, duration: 2, rate: 40, input_len: 24, output_len: 96}
  - {name: after, duration: 25, rate: 0.5, input_len: 16, output_len: 8}
"""


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpilot bench autotune")
    autotune.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_autotuner_switches_on_the_burst_and_back_after_it(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "workload.yaml"
    workload.write_text(WORKLOAD)
    out = tmp_path / "autotune.json"
    args = parse("--quick", "--workload", str(workload), "--serve-args",
                 "--model tiny-llama --load-format dummy --max-num-seqs 2", "--kv-tokens", "512",
                 "--block-sizes", "8", "16", "--preemption-modes", "recompute", "--configs", "16/recompute",
                 "--interval", "0.5", "--cooldown", "2", "--min-dwell", "1",
                 # no configuration gathers a canary window of saturated data: the article's rule alone
                 "--canary-window", "1000", "--output", str(out), "--disable-tqdm")
    assert autotune.run(args) == 0
    body = json.loads(out.read_text())
    assert [r["name"] for r in body["runs"]] == ["static b16 recompute", "autotuner"]  # 8/recompute: not asked for
    assert [r["num_gpu_blocks"] for r in body["runs"]] == [32, 32]
    for run in body["runs"]:
        assert run["overall"]["failed"] == 0 and run["overall"]["completed"] == body["num_requests"]
        assert [p["phase"] for p in run["phases"]] == ["calm", "burst", "after"]
        assert sum(p["num_requests"] for p in run["phases"]) == body["num_requests"]
        assert run["overall"]["ttft_p99_s"] <= run["overall"]["e2e_p99_s"]
    tuner = next(r for r in body["runs"] if r["tuned"])["tuner"]
    first, *rest = tuner["switches"]
    assert (first["from"]["block_size"], first["to"]["block_size"]) == (16, 8)
    assert "queue depth" in first["reason"] and "pressure" in first["reason"] and first["at_s"] >= 3
    assert first["signals"]["queue_depth"] > 6
    assert rest and rest[-1]["to"]["block_size"] == 16 and "calm" in rest[-1]["reason"]
    assert all(s["pause_s"] > 0 for s in tuner["switches"])
    # each switch changes the block size: the engine's own relayout pause, within the call
    assert all(0 <= s["relayout_pause_s"] <= s["pause_s"] for s in tuner["switches"])
    assert tuner["pause_s"] == pytest.approx(sum(s["pause_s"] for s in tuner["switches"]))
    # scrapes time out after the 0.5 s interval: a loaded machine may miss one, and the switches
    # above already show the scraper working
    assert tuner["admin_errors"] == []
    tuned_phases = next(r for r in body["runs"] if r["tuned"])["phases"]
    assert sum(p["switches"] for p in tuned_phases) == len(tuner["switches"])
    assert max(p["queue_depth"] or 0 for p in tuned_phases[1:]) > tuned_phases[0]["queue_depth"]
    compared = body["outputs_vs_unswitched"]
    assert compared["compared"] == body["num_requests"] and compared["differing"] == 0 and compared["lost"] == 0
    verdicts = body["verdicts"]
    assert [p["phase"] for p in verdicts["phases"]] == ["calm", "burst", "after"]
    assert "ttft_p99_vs_default" in verdicts
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "switch at" in printed and "the article claims -40%" in printed and "greedy outputs" in printed


def test_the_built_in_quick_workload_has_the_three_phases_and_repeats_with_the_seed() -> None:
    assert [p.name for p in QUICK] == ["calm", "burst", "long"]
    timed = build_requests(QUICK, seed=1)
    assert timed == build_requests(QUICK, seed=1) and timed != build_requests(QUICK, seed=2)
    assert all(a.at <= b.at for a, b in zip(timed, timed[1:], strict=False))
    by_phase = {i: [t for t in timed if t.phase == i] for i in range(3)}
    assert len(by_phase[1]) / QUICK[1].duration > 3 * len(by_phase[0]) / QUICK[0].duration
    long_prompts = [t.request.prompt for t in by_phase[2]]
    shared = [p for p in long_prompts if p[:32] == long_prompts[0][:32]]  # type: ignore[index]
    assert 1 <= len(shared) < len(long_prompts) or len(long_prompts) < 3


def test_the_h200_workload_files_tell_one_story_and_fit_the_kv_budget() -> None:
    """The 45 s file is the 30 s one with longer calm and long phases around the same burst."""
    folder = Path(__file__).resolve().parents[2] / "benchmarks" / "autotune"
    short, longer = load_phases(folder / "h200-short.yaml"), load_phases(folder / "h200-45s.yaml")
    assert [p.name for p in short] == [p.name for p in longer] == ["calm", "burst", "long"]
    assert (sum(p.duration for p in short), sum(p.duration for p in longer)) == (30, 45)
    assert longer[1] == short[1]
    assert max(p.max_tokens for p in longer) <= 16384  # the --kv-tokens of the H200 command


@pytest.mark.parametrize(("text", "message"), [
    ("phases: []", "non-empty list"),
    ("phases:\n  - {rate: 1, input_len: 4, output_len: 4}", "phase 1: missing duration"),
    ("phases:\n  - {duration: 1, rate: 0, input_len: 4, output_len: 4}", "rate must be positive"),
    ("phases:\n  - {duration: 1, rate: 1, input_len: 4, output_len: 4, speed: 3}", "unknown field(s) speed"),
    ("phases:\n  - {duration: 1, rate: 1, input_len: 4, output_len: 4, prefix_share: 0.5}", "prefix_len must be > 0"),
])
def test_a_bad_workload_file_names_the_phase_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(text)
    with pytest.raises(WorkloadFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_phases(path)


@pytest.mark.parametrize(("flags", "named"), [
    (["--serve-args", "--block-size 8"], "--block-size is set by the benchmark"),
    (["--serve-args", "--no-such-flag"], "--serve-args"),
    (["--kv-tokens", "64"], "--kv-tokens"),
    (["--slo", "ttft=soon"], "--slo"),
    (["--workload", "/no/such.yaml"], "/no/such.yaml"),
    (["--block-sizes", "12"], "--block-sizes"),
    (["--configs", "16/fast"], "--configs"),
    (["--configs", "32/swap"], "--configs"),  # --quick's block sizes are 8 and 16
])
def test_bad_input_fails_with_one_line(flags: list[str], named: str) -> None:
    result = subprocess.run([KVPILOT, "bench", "autotune", "--quick", "--disable-tqdm", *flags], capture_output=True,
                            text=True, env=ENV, timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0] and "error" in lines[0], result.stderr
