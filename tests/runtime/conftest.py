"""Shared fixtures: the embedded SmolLM2 (kvpilot and its Hugging Face twin on the same weights)
and tiny random-weight models of each supported architecture, written as HF folders."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import TINY_CONFIGS, make_tiny_model


@pytest.fixture(scope="session")
def smol_folder() -> str:
    """The embedded model's folder; its tests skip where the model is not installed (a GPU image)."""
    from kvpilot.runtime.model_source import ModelSourceError, resolve_model

    try:
        return resolve_model(None).path
    except ModelSourceError as e:
        pytest.skip(f"the embedded model: {e}")


@pytest.fixture(scope="session")
def smol_llm(smol_folder: str):
    from kvpilot.runtime import LLM

    return LLM(max_model_len=1024, seed=0)


@pytest.fixture(scope="session")
def smol_hf(smol_folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    """kind -> (folder, HF model)"""
    out = {}
    for kind in TINY_CONFIGS:
        folder = tmp_path_factory.mktemp(f"tiny-{kind}")
        out[kind] = (str(folder), make_tiny_model(folder, kind))
    return out
