"""Kernel tests run the Triton kernels on CPU through Triton's interpreter when no GPU is present
(TRITON_INTERPRET must be set before triton is first imported, hence here), and on the GPU
otherwise. The engine's dispatch switch (KVPILOT_KERNELS) is set per test, never suite-wide."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def device() -> torch.device:
    """Where the small-shape tests run: CPU under the interpreter, else the GPU."""
    return torch.device("cpu" if INTERPRETING else "cuda")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
