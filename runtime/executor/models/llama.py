"""The Llama family in kvpilot's own torch code: Llama 2/3 (llama3 rope scaling), Mistral, Qwen2
(q/k/v bias) and tied embeddings (SmolLM2). GQA, RMSNorm, SwiGLU.

Attention, KV writes, norms, rotary and SwiGLU's activation go through `kvpilot.kernels.ops`, so
the same model runs the Triton kernels on CUDA and the reference ops on CPU. q/k/v and gate/up
projections are fused into one matrix each (one GEMM instead of three/two); `load_weights` routes
HF's tensors into them. The four projections are `quant.Linear` layers, whose method (the
checkpoint's weight format: `executor/quant/`) owns their parameters, loading and product, and
may fuse the quantization of their input into the norm or activation before them. Under tensor
parallelism (parallel.py) each rank builds only its slice of every layer and reads only that
slice from the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.ops import Ops, StepPlan
from kvpilot.runtime.executor.kv_scales import checkpoint_scale, scalar
from kvpilot.runtime.executor.models import architecture_of
from kvpilot.runtime.executor.parallel import TPInfo
from kvpilot.runtime.executor.quant.base import Linear, QuantizedInput, WeightSource
from kvpilot.runtime.executor.quant.methods import MethodFor, linear_methods


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
    max_query_len: int  # the most new tokens of any sequence (1: a decode-only step)


class DecoderLayer(nn.Module):
    kv_scales: torch.Tensor

    def __init__(self, cfg: LlamaConfig, tp: TPInfo, method_for: MethodFor, prefix: str) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")[1]
        self.num_kv_heads = tp.split(cfg.num_kv_heads, "num_key_value_heads")[1]
        self.intermediate = tp.split(cfg.intermediate_size, "intermediate_size")[1]
        q, kv, hidden = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim, cfg.hidden_size
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.qkv_proj = Linear(hidden, [q, kv, kv], bias=cfg.attention_bias, parallel="column", tp=tp,
                               method=method_for([f"{prefix}.self_attn.{n}_proj" for n in "qkv"]))
        self.o_proj = Linear(q, [hidden], bias=False, parallel="row", tp=tp,
                             method=method_for([f"{prefix}.self_attn.o_proj"]))
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.gate_up_proj = Linear(hidden, [self.intermediate] * 2, bias=False, parallel="column", tp=tp,
                                   method=method_for([f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"]))
        self.down_proj = Linear(self.intermediate, [hidden], bias=False, parallel="row", tp=tp,
                                method=method_for([f"{prefix}.mlp.down_proj"]))
        self.scale = cfg.head_dim ** -0.5
        # (k_scale, v_scale) of an FP8 KV cache (executor/kv_scales.py); unused by other caches
        self.register_buffer("kv_scales", torch.ones(2, dtype=torch.float32), persistent=False)

    def attention(self, h: torch.Tensor | QuantizedInput, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  plan: StepPlan, ops: Ops) -> torch.Tensor:
        """h: the normed hidden states (T, hidden), as qkv_proj takes them."""
        qkv = self.qkv_proj(h)  # (T, q + 2kv)
        num_tokens, head_dim = qkv.shape[0], self.cfg.head_dim
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # strided views into qkv, no copies: every op takes row strides (unit stride in head_dim)
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, self.num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, head_dim)
        k_cache, v_cache = kv_cache
        ops.rotary_and_write_kv(q, k, v, k_cache, v_cache, plan, self.kv_scales)
        out = ops.paged_attention(q, k_cache, v_cache, plan, self.scale, self.kv_scales)  # (T, H, D)
        return self.tp.all_reduce(self.o_proj(self.o_proj.prepared_input(ops, out.reshape(num_tokens, q_size))))

    def mlp(self, h: torch.Tensor | QuantizedInput, ops: Ops) -> torch.Tensor:
        """h: the normed hidden states (T, hidden), as gate_up_proj takes them."""
        gate_up = self.gate_up_proj(h)  # (T, 2I)
        return self.tp.all_reduce(self.down_proj(self.down_proj.activated_input(ops, gate_up)))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TPInfo | None = None, method_for: MethodFor | None = None) -> None:
        super().__init__()
        method_for = method_for or linear_methods(None, {})
        self.cfg = cfg
        self.tp = tp = tp or TPInfo()
        # vocabulary-parallel: rank r holds rows [r*V/N, (r+1)*V/N) of the padded vocabulary
        self.vocab_per_rank = -(-cfg.vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_per_rank
        # its weight given, not drawn: an Embedding draws it with `normal_`, which on the meta device
        # the loader builds on imports torch._dynamo (seconds of start-up for a value never used)
        self.embed_tokens = nn.Embedding(self.vocab_per_rank, cfg.hidden_size,
                                         _weight=torch.empty(self.vocab_per_rank, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, method_for, f"model.layers.{i}") for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, self.vocab_per_rank, bias=False)
        self.kv_scales_from_checkpoint = False

    def set_kv_scales(self, scales: torch.Tensor) -> None:
        """Every layer's (k_scale, v_scale), (num_layers, 2) or (2,) for all, from any device."""
        for i, layer in enumerate(cast(list[DecoderLayer], self.layers)):
            layer.kv_scales.copy_(scales if scales.dim() == 1 else scales[i])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        h = self.embed_tokens(local.masked_fill(outside, 0))
        h.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(h)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                plan: StepPlan, ops: Ops) -> torch.Tensor:
        """input_ids (T,) -> final-normed hidden states (T, hidden); the plan holds the tokens'
        positions and the step's attention metadata (`Ops.plan`)."""
        eps = self.cfg.rms_norm_eps
        residual = self.embed(input_ids)  # (T, hidden)
        h: torch.Tensor | None = None  # each block's output, added into the residual by the next norm
        for i, layer in enumerate(cast(list[DecoderLayer], self.layers)):
            x = layer.qkv_proj.normed_input(ops, h, residual, layer.input_layernorm, eps)
            h = layer.attention(x, kv_caches[i], plan, ops)
            x = layer.gate_up_proj.normed_input(ops, h, residual, layer.post_attention_layernorm, eps)
            h = layer.mlp(x, ops)
        assert h is not None
        ops.fused_add_rms_norm(h, residual, self.norm, eps)
        return h

    def streamed_weight_bytes(self) -> int:
        """Bytes of this rank's weights a forward pass reads whole: every parameter but an untied
        input embedding, of which it reads only its tokens' rows (a tied one is read whole by the
        LM head). A decode step's bandwidth floor counts these."""
        lookup_only = self.embed_tokens.weight if self.lm_head is not None else None
        return sum(p.numel() * p.element_size() for p in self.parameters() if p is not lookup_only)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) in the model's dtype (the sampler widens the rows that need
        float32: a greedy argmax does not); every rank takes part under tensor parallelism."""
        local = F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        logits = self.tp.all_gather_last_dim(local)
        return logits[:, :self.cfg.vocab_size]

    # HF module -> (our linear layer, shard index within it)
    _LINEARS = {
        "self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1),
        "self_attn.v_proj": ("qkv_proj", 2), "self_attn.o_proj": ("o_proj", 0),
        "mlp.gate_proj": ("gate_up_proj", 0), "mlp.up_proj": ("gate_up_proj", 1), "mlp.down_proj": ("down_proj", 0),
    }

    def _placement(self, name: str) -> Placement:
        """Where the HF tensor `name` (without 'model.') goes, and which part of it this rank reads."""
        cfg = self.cfg
        if name in ("embed_tokens.weight", "lm_head.weight"):
            length = max(0, min(self.vocab_per_rank, cfg.vocab_size - self.vocab_start))
            return Placement(name, 0, 0, self.vocab_start, length, cfg.vocab_size)
        if name == "norm.weight":
            return Placement("norm")
        parts = name.split(".", 2)
        if len(parts) < 3 or parts[0] != "layers":
            return Placement(name)
        layer, rest = f"layers.{parts[1]}", parts[2]
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return Placement(f"{layer}.{rest.removesuffix('.weight')}")
        module, kind = rest.rsplit(".", 1) if "." in rest else (rest, "")
        if module in self._LINEARS:
            ours, shard = self._LINEARS[module]
            return Placement(f"{layer}.{ours}.{kind}", linear=f"{layer}.{ours}", kind=kind, shard=shard)
        return Placement(name)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy this rank's part of each HF-named tensor into the model (the linear layers' through
        their method); every parameter element must be filled exactly once. KV-cache scales
        (kv_scales.py) go to their layers."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        filled: dict[str, int] = {}
        kv: dict[tuple[int, str], float] = {}
        for hf_name, source in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            scale_of = checkpoint_scale(name)
            if scale_of is not None:
                kv[scale_of] = scalar(hf_name, source.read())
                continue
            where = self._placement(name)
            linear = modules.get(where.linear) if where.linear else None
            if isinstance(linear, Linear):
                for kind, count in linear.method.load(linear, where.kind, source, hf_name, where.shard).items():
                    target = f"{where.linear}.{kind}"
                    filled[target] = filled.get(target, 0) + count
                continue
            if where.target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for this {self.cfg.num_layers}-layer model")
            param = params[where.target]
            dest = param.data if where.dim is None else param.data.narrow(0, where.row, where.length)
            expected = tuple(param.shape) if where.dim is None else (where.full, *param.shape[1:])
            if tuple(source.shape) != expected:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(source.shape)}, the model expects {expected}")
            dest.copy_(source.read() if where.dim is None else source.read(where.dim, where.start, where.length))
            filled[where.target] = filled.get(where.target, 0) + dest.numel()
        expected_fill = {n: p.numel() for n, p in params.items()}
        real_vocab = max(0, min(self.vocab_per_rank, self.cfg.vocab_size - self.vocab_start))
        for vocab_name in ("embed_tokens.weight", "lm_head.weight"):
            if vocab_name in params:  # the last shard's padding rows hold no token
                params[vocab_name].data[real_vocab:].zero_()
                expected_fill[vocab_name] = real_vocab * self.cfg.hidden_size
        missing = [n for n in params if filled.get(n, 0) != expected_fill[n]]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(sorted(missing)[:8])}")
        self._load_kv_scales(kv)
        self.process_weights_after_loading()

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def process_weights_after_loading(self) -> None:
        """Once every weight is in (loaded or random): each linear method's last step."""
        for linear in self.linears():
            linear.method.process_after_loading(linear)

    def _load_kv_scales(self, found: dict[tuple[int, str], float]) -> None:
        """The checkpoint's KV-cache scales, found[(layer, "k" | "v" | "kv")], into the layers:
        all of them or none."""
        found = {key: value for key, value in found.items() if key[1] != "q"}
        if not found:
            return
        scales = torch.ones(self.cfg.num_layers, 2)
        for i in range(self.cfg.num_layers):
            both = found.get((i, "kv"))
            k, v = found.get((i, "k"), both), found.get((i, "v"), both)
            if k is None or v is None:
                raise ValueError(f"the checkpoint holds KV-cache scales for some layers but not both for layer {i}")
            scales[i] = torch.tensor([k, v])
        self.set_kv_scales(scales)
        self.kv_scales_from_checkpoint = True


@dataclass(frozen=True)
class Placement:
    """A checkpoint tensor's destination: our parameter `target`, starting at `row`; when `dim`
    is set, this rank reads `length` entries from `start` along that dim of a tensor `full` long.
    A linear layer's tensors name the layer (`linear`), their `kind` and fused `shard` instead:
    its method places them."""

    target: str
    row: int = 0
    dim: int | None = None
    start: int = 0
    length: int = 0
    full: int = 0
    linear: str = ""
    kind: str = ""
    shard: int = 0
