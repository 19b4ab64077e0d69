"""The engine's half of the engine/executor boundary: scheduled sequences become plain step
inputs (tokens back to back, cache slots from each block table, sampling rows for the sequences
that reach their last token)."""

from __future__ import annotations

import itertools

from kvpilot.runtime.engine.step_inputs import PENDING, build_step_inputs
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.scheduler import ScheduledSeq
from kvpilot.runtime.sched.sequence import Request

SEQ_IDS = itertools.count()


def make_seq(prompt: list[int], table: list[int], computed: int, seed: int | None = None, n: int = 1):
    request = Request(request_id="r", prompt=None, prompt_token_ids=prompt,
                      params=SamplingParams(seed=seed, n=n), arrival_time=0.0, seq_ids=SEQ_IDS)
    for seq in request.seqs:
        seq.block_table, seq.num_computed_tokens = list(table), computed
    return request.seqs


def test_a_prefill_chunk_and_a_decode_laid_back_to_back() -> None:
    prefill = make_seq(list(range(10, 20)), [7, 3], computed=0)[0]  # 10 tokens, 6 this step
    decode = make_seq([1, 2, 3, 4, 5], [5, 6], computed=4, seed=100, n=2)[1]  # its last token
    inputs = build_step_inputs([ScheduledSeq(prefill, 6), ScheduledSeq(decode, 1)], block_size=4,
                               eos_token_ids=frozenset({2}), finished_seq_ids=[42])
    assert inputs.input_ids == [10, 11, 12, 13, 14, 15, 5]
    assert inputs.positions == [0, 1, 2, 3, 4, 5, 4]
    # position p goes to block table[p // 4] at offset p % 4
    assert inputs.slot_mapping == [28, 29, 30, 31, 12, 13, 24]
    assert inputs.block_tables == [[7, 3], [5, 6]]
    assert inputs.seq_lens == [6, 5]
    assert inputs.query_start_loc == [0, 6, 7]
    assert not inputs.is_decode_only and inputs.max_query_len == 6
    # the prefill chunk does not reach its last token: only the decode samples
    assert inputs.logits_rows == [6]
    [row] = inputs.sampling_rows
    assert row.seq_id == decode.seq_id and row.seed == 101  # the request's seed + the sample index
    assert row.token_ids == [1, 2, 3, 4, 5] and row.num_prompt_tokens == 5 and row.eos_token_ids == {2}
    assert inputs.finished_seq_ids == [42]


def test_a_pending_token_goes_in_as_a_placeholder_naming_its_sample() -> None:
    """Async scheduling: a sequence whose last token the previous step sampled and the host has not
    seen yet (sequence.py) reads it from that step's samples on the device."""
    known = make_seq([1, 2, 3, 4, 5], [5, 6], computed=4)[0]
    pending = make_seq([7, 8, 9], [2], computed=3)[0]
    pending.num_pending_tokens, pending.pending_sample = 1, 4  # its 4th token: row 4 of the last step's samples
    reprefill = make_seq([20, 21, 22], [3], computed=0)[0]  # preempted with a token pending: prefilled again
    reprefill.num_pending_tokens, reprefill.pending_sample = 1, 0
    inputs = build_step_inputs([ScheduledSeq(known, 1), ScheduledSeq(pending, 1), ScheduledSeq(reprefill, 4)],
                               block_size=4, eos_token_ids=frozenset(), finished_seq_ids=[])
    assert inputs.input_ids == [5, PENDING, 20, 21, 22, PENDING]
    assert inputs.positions == [4, 3, 0, 1, 2, 3]
    assert (inputs.pending_rows, inputs.pending_samples) == ([1, 5], [4, 0])
    assert inputs.logits_rows == [0, 1, 5]


def test_a_chunk_short_of_the_pending_token_is_all_known() -> None:
    seq = make_seq([20, 21, 22, 23, 24], [3, 4], computed=0)[0]
    seq.num_pending_tokens, seq.pending_sample = 1, 2
    inputs = build_step_inputs([ScheduledSeq(seq, 4)], block_size=4, eos_token_ids=frozenset(), finished_seq_ids=[])
    assert inputs.input_ids == [20, 21, 22, 23]
    assert inputs.pending_rows == [] and inputs.logits_rows == []
