"""benchmarks/bench_launch_host.py's engine part on the CPU: every batch size comes out, in the
table and the JSON; decode steps go through the decode graphs' staging as on a GPU; bad arguments
fail clearly."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from file_modules import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_launch_host")


def test_engine_part_writes_a_row_per_batch_and_profiles(bench: ModuleType, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "host.json"
    bench.main(["--parts", "engine", "--batches", "1", "3", "--repeats", "2", "--prompt-len", "20",
                "--new-tokens", "5", "--profile", "5", "--output", str(out)])
    rows = json.loads(out.read_text())["engine"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert len(r["runs_ms"]) == 2 and r["decode_step_ms"] == min(r["runs_ms"]) > 0
    printed = capsys.readouterr().out
    assert "engine decode step, batch    3" in printed and "cProfile over every step of a batch-3 run" in printed
    assert "engine.py" in printed  # the engine's own functions are in the profile


def test_decode_steps_are_staged_as_a_graph_replay_would_be(bench: ModuleType) -> None:
    llm = bench.engine_llm(4, prompt_len=20, new_tokens=5)
    forward = llm.engine.runner._run
    prompts = [[5 + i] * 20 for i in range(3)]
    assert bench.decode_step_ms(llm, prompts, 5, "t") > 0
    # the last decode step wrote the three sequences' positions (20 prompt + 4 sampled - 1) into the
    # static buffers, padded to the captured size 4 with position 0
    assert forward.graphs.positions[:4].tolist() == [23, 23, 23, 0]
    assert forward.graphs.slot_mapping[3].item() == -1
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("argv,message", [
    (["--batches", "0"], "--batches"),
    (["--new-tokens", "1"], "--new-tokens"),
    (["--repeats", "0"], "--repeats"),
    (["--parts", "kernels"], "--parts"),
])
def test_bad_arguments_fail_with_the_flag_named(bench: ModuleType, argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
