"""Step inputs to tensors: the one place the engine's lists become the model's input tensors, for
the eager forward pass (model_runner.py) and for the static buffers of the decode CUDA graphs
(cuda_graphs.py) alike.

The lists go through `array.array` into `torch.frombuffer` (a C loop over the ints, the tensor
shares the array's memory) rather than `torch.tensor(list)`, which checks every element's type and
takes about three times as long: at a decode batch of 256 the block tables alone are ~10k ints a
step."""

from __future__ import annotations

from array import array

import torch

from kvpilot.runtime.executor.inputs import StepInputs
from kvpilot.runtime.executor.models.llama import AttentionMetadata

_TYPECODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


def to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device | str,
              pinned: bool = False) -> torch.Tensor:
    """`values` as a 1-d tensor of `dtype` on `device`. To a GPU through pinned memory, queued
    without waiting: `torch.tensor(values, device=...)` waits for all the work queued on the
    device, which would stall async scheduling (the host preparing step N+1 while the device runs
    step N). `pinned`, with a CPU `device`: in pinned memory, for the caller's own non-blocking copy."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    host = torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)
    if torch.device(device).type == "cpu":
        return host.pin_memory() if pinned else host
    return host.pin_memory().to(device, non_blocking=True)


def _padded_tables(tables: list[list[int]], width: int) -> list[int]:
    """The tables as one row-major list, each row padded with block 0 to `width`."""
    flat: list[int] = []
    for table in tables:
        flat += table
        if len(table) < width:
            flat += [0] * (width - len(table))
    return flat


def to_tensors(inputs: StepInputs, device: torch.device | str, pad_to: int | None = None,
               pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) on `device`; block tables padded with block 0 to the
    widest (columns past a sequence's own blocks are never read: the kernels stop at its context).

    `pad_to` (decode-only steps) adds rows up to that many sequences: token 0 at position 0, a
    cache slot of -1 (the cache write skips it) and a context of one token (it reads some block's
    first slot; its output row is never used), so padding never touches a real sequence's cache.
    """
    input_ids, positions, slots = inputs.input_ids, inputs.positions, inputs.slot_mapping
    seq_lens, tables = inputs.seq_lens, inputs.block_tables
    width = max(len(t) for t in tables)
    if pad_to is not None:
        if not inputs.is_decode_only:
            raise ValueError("only decode steps (one token per sequence) are padded")
        pad = pad_to - inputs.num_seqs
        input_ids, positions, slots = input_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
        seq_lens, tables = seq_lens + [1] * pad, tables + [[0]] * pad
        # one token per row: no list to build or scan
        query_start_loc = torch.arange(pad_to + 1, dtype=torch.int32, device=device)
        max_query_len = 1
    else:
        query_start_loc = to_device(inputs.query_start_loc, torch.int32, device, pinned)
        max_query_len = inputs.max_query_len
    meta = AttentionMetadata(
        slot_mapping=to_device(slots, torch.long, device, pinned),
        block_tables=to_device(_padded_tables(tables, width), torch.int32, device, pinned).view(len(tables), width),
        seq_lens=to_device(seq_lens, torch.int32, device, pinned),
        query_start_loc=query_start_loc,
        max_query_len=max_query_len,
    )
    return to_device(input_ids, torch.long, device, pinned), to_device(positions, torch.long, device, pinned), meta


def fill_pending(input_ids: torch.Tensor, inputs: StepInputs, sampled: torch.Tensor | None) -> None:
    """Write the pending tokens (async scheduling: inputs.py) into `input_ids` on the device, from
    the previous step's sampled tokens `sampled`, in the order the device runs them."""
    if not inputs.pending_rows:
        return
    if sampled is None:
        raise RuntimeError("a step has pending tokens but the previous step sampled none")
    rows, samples = inputs.pending_rows, inputs.pending_samples
    k = len(rows)
    if rows[-1] == k - 1 and rows == samples:  # rows 0..k-1 (they ascend), in the order they sampled: most decodes
        input_ids[:k].copy_(sampled[:k])
        return
    index = to_device(rows + samples, torch.long, input_ids.device)  # one copy
    input_ids.index_copy_(0, index[:k], sampled.index_select(0, index[k:]))
