"""Decode CUDA graphs: which batch sizes are captured, and that CPU engines run without them (the
graphs themselves run only on CUDA: tests/runtime/test_gpu_engine.py)."""

from __future__ import annotations

import pytest

from kvpilot.runtime import LLM
from kvpilot.runtime.executor.cuda_graphs import capture_sizes
from kvpilot.runtime.executor.inputs import StepInputs


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


def test_staging_pads_with_rows_that_write_nowhere() -> None:
    """The static inputs a graph replays: after a larger batch, a smaller one's padding rows must
    not keep the larger batch's cache slots (a replay would write the padding's K/V there)."""
    import torch

    from kvpilot.runtime.executor.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(lambda *_: torch.zeros(0), max_num_seqs=20, max_blocks_per_seq=4,
                          device=torch.device("cpu"))
    assert graphs.sizes == [1, 2, 4, 8, 16, 20]
    ten = list(range(10))
    assert graphs.stage(decode([7] * 10, [5] * 10, [100 + i for i in ten], [[i, i + 1] for i in ten], [6] * 10)) == 16
    assert graphs.slot_mapping[:16].tolist() == [100 + i for i in ten] + [-1] * 6
    assert graphs.stage(decode([1, 2, 3], [9, 8, 7], [40, 41, 42], [[3, 4, 5], [6, 7], [9]], [10, 9, 8])) == 4
    assert graphs.input_ids[:4].tolist() == [1, 2, 3, 0]
    assert graphs.positions[:4].tolist() == [9, 8, 7, 0]
    assert graphs.slot_mapping[:4].tolist() == [40, 41, 42, -1]  # rows 4..15 are not replayed at size 4
    assert graphs.seq_lens[:4].tolist() == [10, 9, 8, 1]
    assert graphs.block_tables[:3, :3].tolist() == [[3, 4, 5], [6, 7, 0], [9, 0, 0]]  # ragged tables padded
    assert graphs.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    # more sequences than the largest graph, or wider tables than max_model_len allows: eager
    assert graphs.stage(decode([0] * 21, [0] * 21, [0] * 21, [[0]] * 21, [1] * 21)) is None
    assert graphs.stage(decode([0], [0], [0], [[0] * 5], [1])) is None


def decode(input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
           seq_lens: list[int]) -> StepInputs:
    """A decode step's inputs: one token per sequence, all sampling."""
    n = len(input_ids)
    return StepInputs(input_ids, positions, slots, tables, seq_lens, list(range(n + 1)), list(range(n)))
