"""The Llama family in kvpilot's own torch code: Llama 2/3 (llama3 rope scaling), Mistral, Qwen2
(q/k/v bias) and tied embeddings (SmolLM2). GQA, RMSNorm, SwiGLU.

Attention, KV writes, norms and rotary go through `kvpilot.kernels.ops`, so the same model runs
the Triton kernels on CUDA and the reference ops on CPU. q/k/v and gate/up projections are fused
into one matrix each (one GEMM instead of three/two); `load_weights` splits HF's tensors into them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.runtime.models import architecture_of


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        arch = architecture_of(hf)
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        # transformers 5 nests rope settings in `rope_parameters`; older configs keep them flat.
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def cos_sin_cache(cfg: LlamaConfig, max_positions: int, device: torch.device) -> torch.Tensor:
    """(max_positions, head_dim) float32: cos in the first half, sin in the second."""
    inv_freq = rope_inv_freq(cfg)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


@dataclass
class AttentionMetadata:
    """Per-step tensors the attention ops need; built by the model runner."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32
    seq_lens: torch.Tensor  # (num_seqs,) int32
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5

    def attention(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  meta: AttentionMetadata, rope: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        cfg = self.cfg
        num_tokens = h.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = self.qkv_proj(h)  # (T, q + 2kv)
        q = qkv[:, :q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim).contiguous()
        k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim).contiguous()
        v = qkv[:, q_size + kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim).contiguous()
        ops.rotary_embedding(positions, q, k, rope)
        k_cache, v_cache = kv_cache
        ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                  meta.query_start_loc, self.scale)  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, q_size))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                rope: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """input_ids, positions (T,) -> final-normed hidden states (T, hidden)."""
        eps = self.cfg.rms_norm_eps
        residual = self.embed_tokens(input_ids)  # (T, hidden)
        h = ops.rms_norm(residual, self.layers[0].input_layernorm, eps)
        for i, layer in enumerate(self.layers):
            if i > 0:
                ops.fused_add_rms_norm(h, residual, layer.input_layernorm, eps)
            h = layer.attention(h, positions, kv_caches[i], meta, rope, ops)
            ops.fused_add_rms_norm(h, residual, layer.post_attention_layernorm, eps)
            h = layer.mlp(h)
        ops.fused_add_rms_norm(h, residual, self.norm, eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()  # (N, vocab)

    # HF name suffix -> (our parameter suffix, shard index within the fused matrix)
    _FUSED = {
        "self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1),
        "self_attn.v_proj": ("qkv_proj", 2), "mlp.gate_proj": ("gate_up_proj", 0),
        "mlp.up_proj": ("gate_up_proj", 1),
    }
    _RENAMED = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj"}

    def _fused_offset(self, fused: str, shard: int) -> tuple[int, int]:
        cfg = self.cfg
        if fused == "qkv_proj":
            sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        else:
            sizes = [cfg.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, rows = self._target(name)
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for this {self.cfg.num_layers}-layer model")
            param = params[target]
            dest = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + dest.shape[0]
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(sorted(missing)[:8])}")

    def _target(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """HF parameter name (without 'model.') -> our name and the row range it fills."""
        if not name.startswith("layers."):
            simple = {"embed_tokens.weight": "embed_tokens.weight", "norm.weight": "norm", "lm_head.weight": "lm_head.weight"}
            return simple.get(name, name), None
        prefix, rest = name.split(".", 2)[:2], name.split(".", 2)[2]
        layer = ".".join(prefix)
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return f"{layer}.{rest.removesuffix('.weight')}", None
        module, kind = rest.rsplit(".", 1)
        if module in self._FUSED:
            fused, shard = self._FUSED[module]
            return f"{layer}.{fused}.{kind}", self._fused_offset(fused, shard)
        if module in self._RENAMED:
            return f"{layer}.{self._RENAMED[module]}.{kind}", None
        return name, None
