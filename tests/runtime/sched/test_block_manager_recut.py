"""The block manager after a re-cut (`reconfigure`, a live block-size change): reference counts
and the free pool follow the holders' new tables, the pool hands out the lowest free ids first and
then blocks freed since in the order they were freed (as the one ordered pool of every free block
it replaces did), and a table naming a block past the new cut is refused."""

from __future__ import annotations

import itertools

import pytest

from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.block_manager import BlockManager
from kvpilot.runtime.sched.sequence import Request, Sequence

SEQ_IDS = itertools.count()


def holder(table: list[int]) -> Sequence:
    seq = Request("r", None, [0], SamplingParams(), arrival_time=0.0, seq_ids=SEQ_IDS).seqs[0]
    seq.block_table = list(table)
    return seq


def test_a_recut_counts_holders_and_hands_out_lowest_free_ids_then_freed_ones_in_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    a, b = holder([5, 2]), holder([2, 7])  # block 2 shared
    bm.reconfigure(12, 8, [a, b])
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks) == (12, 8, 9)
    assert bm.ref_counts[2] == 2 and bm.ref_counts[5] == bm.ref_counts[7] == 1
    assert [bm.is_free(i) for i in (0, 2, 5, 7, 11)] == [True, False, False, False, True]
    first = bm.allocate(3)
    assert first == [0, 1, 3]
    bm.free(a)  # 2 stays held by b; 5 goes back
    bm.free(holder(first[:1]))  # 0 goes back after 5
    assert bm.allocate(8) == [4, 6, 8, 9, 10, 11, 5, 0]
    assert bm.num_free_blocks == 0


def test_a_recut_refuses_a_table_past_the_new_cut() -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="block 9 of 4"):
        bm.reconfigure(4, 32, [holder([9])])
