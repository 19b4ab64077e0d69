"""The scheduler's decision as the executor's input: `build_step_inputs` turns the scheduled
sequences into a `StepInputs` (plain lists; executor/inputs.py defines its layout), so the model
runner never sees a `Sequence`. No torch."""

from __future__ import annotations

from kvpilot.runtime.executor.inputs import SamplingRow, StepInputs
from kvpilot.runtime.sched.scheduler import ScheduledSeq
from kvpilot.runtime.sched.sequence import Request, Sequence

PENDING = -1  # the input id of a pending token until the runner fills it in on the device


def build_step_inputs(scheduled: list[ScheduledSeq], block_size: int, eos_token_ids: frozenset[int],
                      finished_seq_ids: list[int]) -> StepInputs:
    """Each scheduled sequence's next `num_new_tokens` tokens, back to back; the sequences that
    reach their last token sample, in the order they are scheduled. A pending last token (async
    scheduling: sequence.py) goes in as `PENDING`, listed in `pending_rows`. It changes nothing
    unless it returns (the prompt-logprob cursors move at the end), so the engine may call it again."""
    inputs = StepInputs([], [], [], [], [], [0], [], finished_seq_ids=finished_seq_ids)
    cursors: dict[Request, int] = {}  # request -> its prompt-logprob cursor after this step
    input_ids, positions, slot_mapping = inputs.input_ids, inputs.positions, inputs.slot_mapping
    query_start_loc, num_rows = inputs.query_start_loc, 0
    for s in scheduled:
        seq, start = s.seq, s.seq.num_computed_tokens
        table = seq.block_table
        end = start + s.num_new_tokens
        if end > len(seq.token_ids):  # async scheduling: its last token is still on the device
            inputs.pending_rows.append(num_rows + s.num_new_tokens - 1)
            inputs.pending_samples.append(seq.pending_sample)
        if s.num_new_tokens == 1:  # a decode: most rows of most steps, so no ranges or slices
            input_ids.append(seq.token_ids[start] if start < len(seq.token_ids) else PENDING)
            positions.append(start)
            slot_mapping.append(table[start // block_size] * block_size + start % block_size)
        else:
            input_ids.extend(seq.token_ids[start:end])
            if end > len(seq.token_ids):
                input_ids.append(PENDING)
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        if start < seq.num_prompt_tokens - 1 and seq.needs_prompt_logits:  # one comparison for decodes
            _add_prompt_logprob_rows(inputs, seq, start, end, num_rows, cursors)
        inputs.block_tables.append(table)
        inputs.seq_lens.append(start + s.num_new_tokens)
        num_rows += s.num_new_tokens
        query_start_loc.append(num_rows)
        if s.samples:
            inputs.logits_rows.append(num_rows - 1)
            inputs.sampling_rows.append(sampling_row(seq, eos_token_ids))
    for request, cursor in cursors.items():
        request.prompt_logprob_cursor = cursor
    return inputs


def rewind(inputs: StepInputs, scheduled: list[ScheduledSeq]) -> None:
    """Undo what building `inputs` from `scheduled` moved (the prompt-logprob cursors), so that the
    step can be built again, without some of them."""
    requests = {s.seq.request.request_id: s.seq.request for s in scheduled}
    for request_id, count in inputs.prompt_logprob_owners:
        requests[request_id].prompt_logprob_cursor -= count


def _add_prompt_logprob_rows(inputs: StepInputs, seq: Sequence, start: int, end: int, first_row: int,
                             cursors: dict[Request, int]) -> None:
    """Rows for the prompt positions of `start:end` that predict a prompt token and were never
    scheduled for it; the request's cursor (in `cursors` until the step is built) moves past them."""
    request = seq.request
    cursor = cursors.get(request, request.prompt_logprob_cursor)
    begin, stop = max(start, cursor), min(end, seq.num_prompt_tokens - 1)
    if begin >= stop:
        return
    inputs.prompt_logprob_rows.extend(range(first_row + begin - start, first_row + stop - start))
    inputs.prompt_logprob_targets.extend(seq.token_ids[begin + 1:stop + 1])
    inputs.prompt_logprob_k = max(inputs.prompt_logprob_k, request.params.prompt_logprobs or 0)
    inputs.prompt_logprob_owners.append((request.request_id, stop - begin))
    cursors[request] = stop


def sampling_row(seq: Sequence, eos_token_ids: frozenset[int]) -> SamplingRow:
    params = seq.request.params
    seed = params.seed
    # positional, in field order (seq_id, params, token_ids, num_prompt_tokens, eos_token_ids,
    # seed): one row per sampling sequence per step, and keywords double the call's cost
    return SamplingRow(seq.seq_id, params, seq.token_ids, seq.num_prompt_tokens, eos_token_ids,
                       None if seed is None else seed + seq.index)
