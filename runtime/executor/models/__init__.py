"""Model architectures kvpilot implements in its own torch code, chosen from a HF config."""

from __future__ import annotations

from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def architecture_of(hf_config: dict[str, Any]) -> str:
    """The supported architecture a config names, or a ValueError listing the supported ones."""
    names = list(hf_config.get("architectures") or [])
    if not names and hf_config.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[hf_config["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    named = ", ".join(names) or f"model_type {hf_config.get('model_type')!r}"
    raise ValueError(f"unsupported model architecture {named}; kvpilot supports {', '.join(SUPPORTED_ARCHITECTURES)}")
