"""Suite-wide setup. Helpers shared by several test folders live in tests/support (put on
sys.path here; the repo root itself stays off it, so `operator` is always the standard library).

Without a GPU the Triton kernels run under Triton's interpreter. TRITON_INTERPRET must be set
before triton is first imported (the `@triton.jit` helpers in `triton.language` are decorated
then), and any test folder may import a kernel at collection, so it is set here, before any
test module loads. The engine's own choice of ops does not read it (`KVPILOT_KERNELS` does)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "support"))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _release_cuda_memory() -> None:
    """An engine sizes its KV cache from the memory this process has allocated at its peak, so a
    previous test's engine still waiting for the cycle collector would leave the next one no cache.
    Collect it first (on GPU machines only; the CPU runs need nothing)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
