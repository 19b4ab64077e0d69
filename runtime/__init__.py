"""kvpilot's runtime: the paged-attention engine, its models and its OpenAI-compatible server.

The public front door is small: `LLM`, `SamplingParams`, the config types and the `Tokenizer`
(the one the server tokenizes with). They are loaded lazily so that `kvpilot.runtime.cli` (the
console script, also used by the operator image) can be imported without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "kvpilot.runtime.llm",
    "SamplingParams": "kvpilot.runtime.sampling_params",
    "RequestOutput": "kvpilot.runtime.outputs",
    "CompletionOutput": "kvpilot.runtime.outputs",
    "EngineConfig": "kvpilot.runtime.config",
    "CacheConfig": "kvpilot.runtime.config",
    "SchedulerConfig": "kvpilot.runtime.config",
    "ModelConfig": "kvpilot.runtime.config",
    "Tokenizer": "kvpilot.runtime.tokenizer",
}

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput",
    "EngineConfig", "CacheConfig", "SchedulerConfig", "ModelConfig", "Tokenizer",
]

if TYPE_CHECKING:
    from kvpilot.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from kvpilot.runtime.llm import LLM
    from kvpilot.runtime.outputs import CompletionOutput, RequestOutput
    from kvpilot.runtime.sampling_params import SamplingParams
    from kvpilot.runtime.tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpilot.runtime' has no attribute {name!r}")
    return getattr(import_module(module), name)
