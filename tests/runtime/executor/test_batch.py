"""Step inputs to tensors (batch.py): ragged block tables padded, decode batches padded with rows
that write nowhere."""

from __future__ import annotations

import pytest

from kvpilot.runtime.executor.batch import fill_pending, to_tensors
from kvpilot.runtime.executor.inputs import StepInputs


def test_eager_tensors_keep_the_rows_and_pad_tables_with_block_0() -> None:
    inputs = StepInputs([5, 6, 7], [0, 1, 9], [8, 9, 41], [[2], [4, 5, 10]], [2, 10], [0, 2, 3], [1, 2])
    input_ids, positions, meta = to_tensors(inputs, "cpu")
    assert input_ids.tolist() == [5, 6, 7] and positions.tolist() == [0, 1, 9]
    assert meta.slot_mapping.tolist() == [8, 9, 41]
    assert meta.block_tables.tolist() == [[2, 0, 0], [4, 5, 10]]
    assert meta.seq_lens.tolist() == [2, 10] and meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.max_query_len == 2


def test_padding_a_decode_step_adds_one_token_rows_with_no_cache_slot() -> None:
    inputs = StepInputs([5, 6], [3, 9], [11, 41], [[2], [4, 5, 10]], [4, 10], [0, 1, 2], [0, 1])
    input_ids, positions, meta = to_tensors(inputs, "cpu", pad_to=4)
    assert input_ids.tolist() == [5, 6, 0, 0] and positions.tolist() == [3, 9, 0, 0]
    assert meta.slot_mapping.tolist() == [11, 41, -1, -1]
    assert meta.seq_lens.tolist() == [4, 10, 1, 1] and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.block_tables.shape == (4, 3) and meta.max_query_len == 1


def test_only_decode_steps_are_padded() -> None:
    inputs = StepInputs([5, 6], [0, 1], [8, 9], [[2]], [2], [0, 2], [1])
    with pytest.raises(ValueError, match="only decode steps"):
        to_tensors(inputs, "cpu", pad_to=4)


def test_pending_tokens_are_filled_from_the_previous_steps_samples() -> None:
    import torch

    inputs = StepInputs(input_ids=[5, -1, 7, -1], positions=[3, 4, 0, 9], slot_mapping=[3, 4, 8, 9],
                        block_tables=[[0, 1], [2], [3, 4]], seq_lens=[4, 1, 10], query_start_loc=[0, 1, 3, 4],
                        logits_rows=[0, 2, 3], pending_rows=[1, 3], pending_samples=[2, 0])
    input_ids, _, _ = to_tensors(inputs, "cpu")
    fill_pending(input_ids, inputs, torch.tensor([40, 41, 42]))
    assert input_ids.tolist() == [5, 42, 7, 40]
    inputs.pending_rows, inputs.pending_samples = [0, 1], [0, 1]  # a decode step in its samples' order
    fill_pending(input_ids, inputs, torch.tensor([50, 51, 52]))
    assert input_ids.tolist() == [50, 51, 7, 40]
    with pytest.raises(RuntimeError, match="sampled none"):
        fill_pending(input_ids, inputs, None)
