"""The shared tile walk (tiles.attend_keys): block ids loaded in the tile's own iteration or one
ahead, in the decode and the prefill kernel."""

from __future__ import annotations

import pytest
import torch
from paged_batches import DECODE, MIXED, dense_float64, make_batch, rel_err, run_triton, tolerance

from kvpilot.kernels.paged_attention import DecodeConfig, PrefillConfig


@pytest.mark.parametrize("prefetch", [False, True], ids=["ids-in-loop", "ids-ahead"])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("specs", [DECODE, MIXED, [(150, 150), (140, 60), (97, 1)]], ids=["decode", "mixed", "long"])
def test_block_id_prefetch_either_way_matches_reference(
    specs: list[tuple[int, int]], block_size: int, num_splits: int | None, prefetch: bool, device: torch.device
) -> None:
    """Both ways to load block ids (in the tile's own iteration, or one ahead), in decode and
    prefill: decode defaults to the first and prefill to the second, so each default leaves the
    other way untested elsewhere."""
    batch = make_batch(specs, 8, 2, 64, block_size, torch.float32, device, poison_unused=True)
    stages = 1 if device.type == "cpu" else 3
    out = run_triton(batch, 0.125, hint=True, num_splits=num_splits,
                     decode=DecodeConfig(block_n=16, num_stages=stages, prefetch=prefetch),
                     prefill=PrefillConfig(block_m=32, block_n=16, num_stages=stages, prefetch=prefetch))
    assert rel_err(out, dense_float64(batch, 0.125)) < tolerance(torch.float32, device)
