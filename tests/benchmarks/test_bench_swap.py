"""benchmarks/bench_swap.py on the CPU with a tiny model: every (block size, context) row, the
overlap rows and both modes of the served workload come out, in the table and the JSON; bad
arguments fail clearly."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from file_modules import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_swap")


def test_smoke_run_writes_every_row_and_both_modes(bench: ModuleType, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "swap.json"
    bench.main(["--model", "tiny-llama", "--device", "cpu", "--contexts", "24", "40", "--block-sizes", "8", "16",
                "--reps", "1", "--kv-tokens", "128", "--max-model-len", "64", "--swap-space", "0.01",
                "--copy-mib", "1", "--parts", "per-sequence", "overlap", "served", "--overlap-batch", "2",
                "--overlap-context", "16", "--overlap-steps", "2", "--num-prompts", "5", "--input-len", "24", "--output-len", "32",
                "--request-rate", "inf", "--output", str(out)])
    result = json.loads(out.read_text())
    rows = result["per_sequence"]
    assert [(r["block_size"], r["context"]) for r in rows] == [(8, 24), (8, 40), (16, 24), (16, 40)]
    for r in rows:
        assert r["bytes_each_way"] == -(-r["context"] // r["block_size"]) * r["block_size"] * 2 * 2 * 2 * 16 * 4
        assert r["swap_ms"] > 0 and r["recompute_ms"] > 0 and r["of_copy_rate"] > 0
    assert set(result["crossover_context"]) == {"8", "16"}
    assert [(r["block_size"], r["context_swapped"]) for r in result["overlap"]] == [(8, 16), (16, 16)]
    assert all(r["step_ms"] > 0 and r["step_with_swap_ms"] > 0 and r["swap_ms"] > 0 for r in result["overlap"])
    served = result["served"]
    assert [(r["block_size"], r["mode"]) for r in served] == [(16, "recompute"), (16, "swap")]
    # five sequences growing from 24 to 56 tokens over 128 token slots: both modes preempt, only swap moves bytes
    assert all(r["preemptions"] > 0 for r in served)
    assert served[0]["swap_GB"] == 0 and served[1]["swapped_out"] > 0 and served[1]["swap_GB"] > 0
    printed = capsys.readouterr().out
    assert "| block_size | context |" in printed and "crossover" in printed


@pytest.mark.parametrize("argv,message", [
    (["--block-sizes", "12"], "--block-sizes: 12 is not one of"),
    (["--contexts", "9000"], "--contexts"),
    (["--kv-tokens", "100"], "--kv-tokens"),
])
def test_bad_arguments_fail_with_the_flag_named(bench: ModuleType, argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
