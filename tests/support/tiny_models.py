"""Tiny random-weight HF models of each supported architecture, and HF's greedy reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "llama3-rope": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64), rope_theta=500000.0),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False),
    "tied-mha": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
                     num_key_value_heads=4),
}


def make_tiny_model(folder: Path, kind: str, seed: int = 0):
    """A random-weight HF model of `kind`, saved as safetensors; returns the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(TINY_CONFIGS[kind])
    model_type = extra.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=extra.pop("num_key_value_heads", 2),
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=extra.pop("tie_word_embeddings", False),
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than HF's init: peaky logits, no near-ties in argmax
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.25 if "embed" not in name else 1.0)
            elif "bias" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    """HF transformers' greedy continuation of one unpadded prompt."""
    ids = torch.tensor([prompt_ids])
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    if not stop_at_eos:
        kwargs.update(eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    return out[0, len(prompt_ids):].tolist()
