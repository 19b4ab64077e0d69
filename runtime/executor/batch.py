"""Step inputs to tensors: the one place the engine's lists become the model's input tensors, for
the eager forward pass (model_runner.py) and for the static buffers of the decode CUDA graphs
(cuda_graphs.py) alike."""

from __future__ import annotations

import torch

from kvpilot.runtime.executor.inputs import StepInputs
from kvpilot.runtime.executor.models.llama import AttentionMetadata


def to_tensors(inputs: StepInputs, device: torch.device | str,
               pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) on `device`; block tables padded with block 0 to the
    widest (columns past a sequence's own blocks are never read: the kernels stop at its context).

    `pad_to` (decode-only steps) adds rows up to that many sequences: token 0 at position 0, a
    cache slot of -1 (the cache write skips it) and a context of one token (it reads some block's
    first slot; its output row is never used), so padding never touches a real sequence's cache.
    """
    input_ids, positions, slots = inputs.input_ids, inputs.positions, inputs.slot_mapping
    seq_lens, query_start_loc, tables = inputs.seq_lens, inputs.query_start_loc, inputs.block_tables
    width = max(len(t) for t in tables)
    if pad_to is not None:
        if not inputs.is_decode_only:
            raise ValueError("only decode steps (one token per sequence) are padded")
        pad = pad_to - inputs.num_seqs
        input_ids, positions, slots = input_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
        seq_lens, query_start_loc = seq_lens + [1] * pad, list(range(pad_to + 1))
        tables = tables + [[0]] * pad
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        max_query_len=inputs.max_query_len,
    )
    return (torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device), meta)
