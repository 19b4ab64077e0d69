"""The prefill kernel: long prefills and chunked prefills spanning many query and key tiles."""

from __future__ import annotations

import torch
from paged_batches import make_batch, rel_err, run_triton, tolerance

from kvpilot.kernels import reference


def test_long_prefill_spans_many_tiles(device: torch.device) -> None:
    batch = make_batch([(150, 150), (140, 60)], 4, 2, 64, 16, torch.float32, device)
    out = run_triton(batch, 0.125)
    assert rel_err(out, reference.paged_attention(*batch, 0.125)) < tolerance(torch.float32, device)
