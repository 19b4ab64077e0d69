"""`kvpilot bench autotune` on a tiny dummy model: real `kvpilot serve` processes, a burst that the
operator's own tuning step answers with a canary on the live server, judged and ended, and the
calm after it proposing 16 again; the switches' pauses, per-phase figures, the oracle and the targets,
greedy outputs unchanged; the screening of each phase alone; and its input errors, one line each."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvpilot.bench import autotune
from kvpilot.bench.autotune_workload import QUICK, WorkloadFileError, build_requests, load_phases

KVPILOT = str(Path(sys.executable).parent / "kvpilot")
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}
# The burst arrives at once (some 55 requests in half a second): with max_num_seqs 2 it queues
# dozens whatever the machine's speed, where a burst spread over seconds is served as it comes on a
# fast machine (a quiet 2-core CI run: a 48-token request in ~0.1 s, no queue at all). Draining
# it takes some 1,300 steps: at least two of the tuner's 0.5 s passes see the queue down to a step
# of ~1 ms, and the calm after it has room for the canary's end and the way back to 16 up to a step
# of ~15 ms. (The workload is timed, so no size fits every speed; this one centres on CI's.)
WORKLOAD = """\
phases:
  - {name: calm, duration: 3, rate: 1, input_len: 16, output_len: 8}
  - {name: burst, duration: 0.5, rate: 140, input_len: 24, output_len: 48}
  - {name: after, duration: 25, rate: 0.5, input_len: 16, output_len: 8}
"""


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpilot bench autotune")
    autotune.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_autotuner_tries_a_canary_on_the_burst_and_proposes_16_again_after_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "workload.yaml"
    workload.write_text(WORKLOAD)
    out = tmp_path / "autotune.json"
    args = parse("--quick", "--workload", str(workload), "--serve-args", "--model tiny-llama --load-format dummy",
                 "--kv-tokens", "512", "--block-sizes", "8", "16", "--preemption-modes", "recompute",
                 "--max-num-seqs", "2", "--configs", "16/recompute/2", "--interval", "0.5", "--cooldown", "2",
                 "--min-dwell", "1", "--canary-window", "2", "--canary-min-requests", "1", "--output", str(out),
                 "--disable-tqdm")
    assert autotune.run(args) == 0
    body = json.loads(out.read_text())
    assert [r["name"] for r in body["runs"]] == ["static b16 recompute s2", "autotuner"]  # 8/recompute: not asked for
    assert [r["num_gpu_blocks"] for r in body["runs"]] == [32, 32] and body["baseline"] == "static b16 recompute s2"
    for run in body["runs"]:
        assert run["overall"]["failed"] == 0 and run["overall"]["completed"] == body["num_requests"]
        assert [p["phase"] for p in run["phases"]] == ["calm", "burst", "after"]
        assert sum(p["num_requests"] for p in run["phases"]) == body["num_requests"]
        assert run["overall"]["ttft_p99_s"] <= run["overall"]["e2e_p99_s"]
    tuner = next(r for r in body["runs"] if r["tuned"])["tuner"]
    first, *rest = tuner["switches"]
    # the operator's step: the change goes to the (only) pod as a canary, on the queue the burst made
    assert first["action"] == "canary" and (first["from"]["block_size"], first["to"]["block_size"]) == (16, 8)
    assert "queue depth" in first["reason"] and "pressure" in first["reason"] and first["at_s"] >= 3
    kinds = [r["reason"].split(" ")[0] for r in tuner["records"]]
    assert kinds[0] == "canary" and kinds[1] in ("promoted", "rolled")  # the canary was judged and ended
    # after the burst 16 comes back: the burst's canary rolled back, or the calm proposes 16 again
    # (whether that canary is kept is judged on the P99 latencies of a request or two a window,
    # --canary-min-requests 1, which a loaded machine's noise decides either way)
    assert any(s["to"]["block_size"] == 16 and (s["action"] == "roll_back" or "calm" in s["reason"]) for s in rest)
    assert all(s["pause_s"] > 0 for s in tuner["switches"])
    assert all(0 <= s["relayout_pause_s"] <= s["pause_s"] for s in tuner["switches"])
    assert tuner["pause_s"] == pytest.approx(sum(s["pause_s"] for s in tuner["switches"]))
    assert tuner["admin_errors"] == []
    tuned_phases = next(r for r in body["runs"] if r["tuned"])["phases"]
    assert sum(p["switches"] for p in tuned_phases) == len(tuner["switches"])
    compared = body["outputs_vs_unswitched"]
    assert compared["compared"] == body["num_requests"] and compared["differing"] == 0 and compared["lost"] == 0
    verdicts = body["verdicts"]
    assert [p["phase"] for p in verdicts["phase_best"]] == ["calm", "burst", "after"]
    assert verdicts["oracle_goodput"] == pytest.approx(verdicts["best_static_goodput"])  # one static: no gain
    (run,) = verdicts["autotuner"]
    assert {"goodput", "meets_goodput_target", "ttft_p99_vs_default", "meets_ttft_target"} <= run.keys()
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "switch at" in printed and "oracle" in printed and "greedy outputs" in printed


# Short prompts that grow long answers in a KV budget of six blocks: four sequences admitted at one
# block each outgrow it, so the burst thrashes (preemptions, KV usage near 1) while requests queue.
# The burst lasts 2 s (some 96 requests), so that the tuner's 0.5 s passes see the thrash however
# fast the machine drains it (half a second's burst was sometimes over between two passes: no canary),
# and the calm after it outlasts the canary's timeout (3 s) however late in the drain it starts.
BATCH_LIMIT_WORKLOAD = """\
phases:
  - {name: calm, duration: 1, rate: 1, input_len: 8, output_len: 40}
  - {name: burst, duration: 2, rate: 48, input_len: 8, output_len: 40}
  - {name: after, duration: 15, rate: 0.5, input_len: 8, output_len: 40}
"""


def test_the_autotuner_tries_a_batch_limit_from_its_range_as_a_canary_and_ends_it(tmp_path: Path) -> None:
    """Only max_num_seqs may move (one block size, one mode), within 2..4: memory thrashing on the
    burst halves it on a canary, which is judged on and ended, outputs unchanged."""
    workload = tmp_path / "workload.yaml"
    workload.write_text(BATCH_LIMIT_WORKLOAD)
    out = tmp_path / "autotune.json"
    args = parse("--quick", "--workload", str(workload), "--serve-args", "--model tiny-llama --load-format dummy",
                 "--kv-tokens", "96", "--block-sizes", "16", "--preemption-modes", "recompute",
                 "--max-num-seqs", "2", "4", "--configs", "16/recompute/4", "--interval", "0.5", "--cooldown", "2",
                 "--min-dwell", "1", "--canary-window", "1", "--canary-min-requests", "1", "--output", str(out),
                 "--disable-tqdm")
    assert autotune.run(args) == 0
    body = json.loads(out.read_text())
    assert body["tuning_spec"]["max_num_seqs"] == {"min": 2, "max": 4}
    tuned = next(r for r in body["runs"] if r["tuned"])
    assert tuned["max_num_seqs"] == 4  # started at the range's top, as the engine's own default is its largest
    first, *rest = tuned["tuner"]["switches"]
    assert first["action"] == "canary" and "memory binds" in first["reason"]
    assert (first["from"]["max_num_seqs"], first["to"]["max_num_seqs"]) == (4, 2)
    assert {k: v for k, v in first["to"].items() if k != "max_num_seqs"} == \
        {k: v for k, v in first["from"].items() if k != "max_num_seqs"}  # nothing else moved
    ended = [r["reason"] for r in tuned["tuner"]["records"][1:2]]
    assert ended and ended[0].startswith(("promoted from pod", "rolled back on pod")), tuned["tuner"]["records"]
    assert all(s["to"]["max_num_seqs"] in (2, 4) for s in tuned["tuner"]["switches"])  # never out of the range
    assert tuned["overall"]["failed"] == 0 and tuned["tuner"]["admin_errors"] == []
    compared = body["outputs_vs_unswitched"]
    assert compared["compared"] == body["num_requests"] and compared["differing"] == 0 and compared["lost"] == 0


def test_screening_runs_each_phase_alone_on_every_static_configuration(tmp_path: Path) -> None:
    out = tmp_path / "screen.json"
    args = parse("--quick", "--workload", str(tmp_path / "w.yaml"), "--serve-args",
                 "--model tiny-llama --load-format dummy", "--kv-tokens", "512", "--block-sizes", "16",
                 "--preemption-modes", "recompute", "--max-num-seqs", "2", "4", "--screen", "2", "--output", str(out),
                 "--disable-tqdm")
    (tmp_path / "w.yaml").write_text("phases:\n  - {name: a, duration: 60, rate: 2, input_len: 8, output_len: 4}\n"
                                     "  - {name: b, duration: 60, rate: 4, input_len: 16, output_len: 8}\n")
    assert autotune.run(args) == 0
    body = json.loads(out.read_text())
    assert [r["name"] for r in body["runs"]] == ["static b16 recompute s2", "static b16 recompute s4"]
    assert body["screen_s"] == 2 and [p["duration"] for p in body["workload"]] == [2, 2]
    for run in body["runs"]:
        assert run["overall"]["failed"] == 0 and [p["num_requests"] for p in run["phases"]] != [0, 0]
        sent = [(r["phase"], r["sent_s"]) for r in run["requests"]]
        assert all((0 <= t < 2) if phase == 0 else (2 <= t < 4) for phase, t in sent)  # on the workload's clock
    assert "autotuner" not in body["verdicts"] and len(body["verdicts"]["phase_best"]) == 2


def test_the_oracle_and_the_targets_are_judged_from_each_phases_best() -> None:
    from kvpilot.bench.autotune_report import _verdicts
    from kvpilot.bench.autotune_workload import Phase

    phases = (Phase("chat", 60, 1, 8, 8), Phase("batch", 120, 1, 8, 8))

    def run(name: str, tuned: bool, chat: float, batch: float, ttft: float = 1.0, config: str = "") -> dict[str, object]:
        return {"name": name, "config": config or name, "tuned": tuned,
                "phases": [{"goodput": chat}, {"goodput": batch}],
                "overall": {"goodput": (60 * chat + 120 * batch) / 180, "ttft_p99_s": ttft}}
    # A is best for chat, B for batch: the oracle switches at the phase boundary
    runs = [run("static b16 recompute", False, 10, 3), run("static b8 swap", False, 6, 6),
            run("autotuner", True, 9.8, 5.9, ttft=0.6)]
    v = _verdicts(runs, phases, "static b16 recompute")  # type: ignore[arg-type]
    assert v["optima_differ"] and v["best_static"] == "static b8 swap" and v["best_static_goodput"] == 6
    assert v["oracle_goodput"] == pytest.approx((60 * 10 + 120 * 6) / 180)
    assert v["oracle_gain"] == pytest.approx(v["oracle_goodput"] - 6)
    assert v["goodput_target"] == pytest.approx(6 + v["oracle_gain"] / 2)
    (tuned,) = v["autotuner"]
    assert tuned["meets_goodput_target"] and tuned["meets_ttft_target"] and tuned["ttft_p99_vs_default"] == 0.6
    assert [p["within_5_percent_of_oracle"] for p in tuned["phases"]] == [True, True]
    runs[2] = run("autotuner", True, 9.0, 6.0)
    assert [p["within_5_percent_of_oracle"] for p in _verdicts(runs, phases, None)["autotuner"][0]["phases"]] \
        == [False, True]


def test_with_repeats_the_verdicts_use_each_configuration_s_mean_and_report_its_spread() -> None:
    """Two runs of each static configuration: one lucky run of A (chat 12) does not make A the
    chat phase's best when its mean is lower than B's; every configuration's spread of goodput,
    P99 TTFT and per-phase goodput is reported, and each autotuner run judged against the means."""
    from kvpilot.bench.autotune_report import _verdicts
    from kvpilot.bench.autotune_workload import Phase

    phases = (Phase("chat", 60, 1, 8, 8), Phase("batch", 120, 1, 8, 8))

    def run(config: str, repeat: int, chat: float, batch: float, ttft: float) -> dict[str, object]:
        return {"name": f"{config} #{repeat}", "config": config, "tuned": config == "autotuner",
                "phases": [{"goodput": chat}, {"goodput": batch}],
                "overall": {"goodput": (60 * chat + 120 * batch) / 180, "ttft_p99_s": ttft}}
    runs = [run("static a", 1, 12, 3, 1.0), run("static a", 2, 4, 3, 3.0),
            run("static b", 1, 9, 5, 2.0), run("static b", 2, 9, 5, 2.0),
            run("autotuner", 1, 9, 5, 1.0), run("autotuner", 2, 8, 4, 1.6)]
    v = _verdicts(runs, phases, "static a")  # type: ignore[arg-type]
    assert [p["config"] for p in v["phase_best"]] == ["static b", "static b"] and not v["optima_differ"]
    spread = {c["config"]: c for c in v["spread"]}
    assert spread["static a"]["runs"] == 2
    assert spread["static a"]["phases"][0]["goodput"] == {"mean": 8, "min": 4, "max": 12}
    assert spread["static a"]["ttft_p99_s"] == {"mean": 2.0, "min": 1.0, "max": 3.0}
    assert spread["autotuner"]["goodput"]["min"] == pytest.approx((60 * 8 + 120 * 4) / 180)
    first, second = v["autotuner"]
    assert first["ttft_p99_vs_default"] == 0.5 and second["ttft_p99_vs_default"] == pytest.approx(0.8)
    assert first["meets_ttft_target"] and not second["meets_ttft_target"]
    assert v["autotuner_goodput"]["max"] == first["goodput"]


def test_the_built_in_quick_workload_has_the_three_phases_and_repeats_with_the_seed() -> None:
    assert [p.name for p in QUICK] == ["calm", "burst", "long"]
    timed = build_requests(QUICK, seed=1)
    assert timed == build_requests(QUICK, seed=1) and timed != build_requests(QUICK, seed=2)
    assert all(a.at <= b.at for a, b in zip(timed, timed[1:], strict=False))
    by_phase = {i: [t for t in timed if t.phase == i] for i in range(3)}
    assert len(by_phase[1]) / QUICK[1].duration > 3 * len(by_phase[0]) / QUICK[0].duration


def test_a_prefix_share_shares_exactly_its_prefix_with_that_share_of_the_requests() -> None:
    from kvpilot.bench.autotune_workload import Phase

    phase = Phase("long", 100, 4, input_len=16, output_len=4, prefix_share=0.5, prefix_len=32)
    prompts = [list(t.request.prompt) for t in build_requests((phase,), seed=3)]  # type: ignore[arg-type]
    heads = Counter(tuple(p[:32]) for p in prompts)
    (prefix, sharing), *others = heads.most_common()
    assert 0.4 < sharing / len(prompts) < 0.6 and len(prompts) > 300
    assert all(count == 1 for _, count in others)  # the rest start with random tokens of their own
    # exactly the prefix is shared: the tokens after it are the requests' own
    assert len({tuple(p[32:40]) for p in prompts if tuple(p[:32]) == prefix}) == sharing


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
    (["--configs", "16/recompute/64/512"], "--configs"),  # no --max-num-seqs grid to lie within
    (["--max-num-seqs", "2", "4", "--serve-args", "--max-num-seqs 8"], "--max-num-seqs is set by the benchmark"),
])
def test_bad_input_fails_with_one_line(flags: list[str], named: str) -> None:
    result = subprocess.run([KVPILOT, "bench", "autotune", "--quick", "--disable-tqdm", *flags], capture_output=True,
                            text=True, env=ENV, timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0] and "error" in lines[0], result.stderr


def test_the_evaluation_workloads_have_their_three_phases_and_fit_their_kv_budgets() -> None:
    """Five minutes of arrivals on the CPU and on the H200 (their files' comments give --kv-tokens
    1024 and 32768), each request within the budget and within the 8192-token context the H200
    grid's smallest step budget is chunked against; the phases ask different things: a light
    chat load, long prompts, a heavy batch of short requests."""
    folder = Path(__file__).resolve().parents[2] / "benchmarks" / "autotune"
    cpu, h200 = load_phases(folder / "cpu-phased.yaml"), load_phases(folder / "h200-phased.yaml")
    assert [p.name for p in cpu] == [p.name for p in h200] == ["chat", "long", "batch"]
    assert sum(p.duration for p in cpu) >= 300 and sum(p.duration for p in h200) >= 300
    assert max(p.max_tokens for p in cpu) <= 1024 and max(p.max_tokens for p in h200) <= 8192 <= 32768
    chat, long, batch = h200
    assert long.input_len > 10 * chat.input_len and long.prefix_share > 0
    assert batch.rate > 5 * chat.rate and batch.burstiness < 1 and batch.max_tokens < chat.max_tokens
