"""Decode CUDA graphs: which batch sizes are captured, and that CPU engines run without them (the
graphs themselves run only on CUDA: tests/runtime/test_gpu_engine.py)."""

from __future__ import annotations

import pytest

from kvpilot.runtime import LLM
from kvpilot.runtime.cuda_graphs import capture_sizes


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]),
    (3, [1, 2, 3]),
    (6, [1, 2, 4, 6]),
    (20, [1, 2, 4, 8, 16, 20]),
    (256, [1, 2, 4, *range(8, 257, 8)]),
    (1000, [1, 2, 4, *range(8, 513, 8)]),
])
def test_capture_sizes_cover_every_batch_with_less_than_8_rows_of_padding(max_num_seqs: int, expected: list[int]) -> None:
    sizes = capture_sizes(max_num_seqs)
    assert sizes == expected
    for n in range(1, min(max_num_seqs, 512) + 1):
        padded = next(s for s in sizes if s >= n)
        assert padded - n < 8


def test_cpu_engine_has_no_graphs(tiny_models) -> None:
    folder, _ = tiny_models["llama"]
    llm = LLM(folder, device="cpu", max_model_len=64)
    assert llm.engine.runner.graphs is None


def test_graphs_are_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpilot.runtime.cuda_graphs import graphs_enabled

    monkeypatch.delenv("KVPILOT_CUDA_GRAPHS", raising=False)
    assert not graphs_enabled()
    monkeypatch.setenv("KVPILOT_CUDA_GRAPHS", "1")
    assert graphs_enabled()
