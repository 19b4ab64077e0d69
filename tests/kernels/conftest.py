"""Kernel tests run the Triton kernels on CPU through Triton's interpreter when no GPU is present
(tests/conftest.py sets TRITON_INTERPRET then, before anything imports triton), and on the GPU
otherwise. The engine's dispatch switch (KVPILOT_KERNELS) is set per test, never suite-wide."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def device() -> torch.device:
    """Where the small-shape tests run: CPU under the interpreter, else the GPU."""
    return torch.device("cpu" if INTERPRETING else "cuda")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
