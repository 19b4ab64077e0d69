"""FP8 weights (`--quantization fp8`): float8 e4m3 weights with one float32 scale per output
channel, activations quantized per token (or with a static per-layer scale) by the op before the
layer, one FP8 GEMM with both scales applied to its float32 accumulators.

Two sources, one layout (`weight` (N, K) float8_e4m3fn, `weight_scale` (N, 1) float32):
* a plain checkpoint (bf16/fp16/fp32) is quantized while it loads, one tensor at a time on the
  device: each output channel (row) scaled by its largest magnitude / 448;
* a pre-quantized checkpoint in the compressed-tensors layout (llm-compressor's FP8 schemes) or
  the older `quant_method: fp8` one: float8 `weight` with `weight_scale` per channel (N, 1) or per
  tensor (a per-tensor scale is repeated over the rows it covers, so a fused layer's q/k/v keep
  their own), and `input_scale` per tensor when activations are static (a fused layer quantizes
  its one input with the largest of its shards' scales, which never overflows).
The product: on CUDA `torch._scaled_mm` (cuBLASLt) with row-wise scales, but for steps of at most
`fp8_gemv.MAX_ROWS` tokens (decode at small batch) a Triton kernel that streams the weight at
full bandwidth (kernels/fp8_gemv.py; benchmarks/bench_fp8_gpu.py times both); elsewhere
de-quantized compute on the same quantized values, so CPU runs check loaders, scales and numerics.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from kvpilot.kernels.kv_quant import FP8
from kvpilot.kernels.ops import Ops
from kvpilot.kernels.reference import quantize_fp8
from kvpilot.runtime.executor.quant.base import (
    Linear,
    LinearMethod,
    ParamLayout,
    QuantizedInput,
    WeightSource,
)


@functools.cache
def _gemv() -> ModuleType | None:
    """kernels/fp8_gemv.py, imported by the first product on CUDA: it imports Triton, a good part of
    a second that a start on the CPU never needs; None without Triton (a CPU-only install)."""
    try:
        from kvpilot.kernels import fp8_gemv
    except ImportError:
        return None
    return fp8_gemv


@dataclass(frozen=True)
class Fp8Scheme:
    """What the checkpoint holds: `prequantized` float8 weights (else a plain checkpoint quantized
    at load), `static_input` scales (else per-token dynamic), and the modules left unquantized."""

    prequantized: bool = False
    static_input: bool = False
    ignore: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> Fp8Scheme:
        qc = hf_config.get("quantization_config") or {}
        if not qc:
            return cls()
        if qc.get("quant_method") == "fp8":  # vLLM's and AutoFP8's layout: per-tensor scales
            return cls(prequantized=True, static_input=qc.get("activation_scheme", "dynamic") == "static",
                       ignore=tuple(qc.get("ignored_layers") or ()))
        statics = set()
        for name, group in (qc.get("config_groups") or {}).items():
            weights, acts = group.get("weights") or {}, group.get("input_activations")
            if weights.get("strategy") not in ("channel", "tensor"):
                raise ValueError(f"quantization_config: group {name}'s weight strategy {weights.get('strategy')!r} "
                                 "is not served; FP8 weights are read per channel or per tensor")
            if acts is None:
                raise ValueError(f"quantization_config: group {name} leaves activations unquantized (FP8 weights "
                                 "only); kvpilot serves FP8 weights with FP8 activations")
            if acts.get("strategy") not in ("token", "tensor") or acts.get("type", "float") != "float":
                raise ValueError(f"quantization_config: group {name}'s activations {acts.get('type')} "
                                 f"{acts.get('strategy')} are not served; FP8 per token or per tensor")
            statics.add(not acts.get("dynamic", True))
        if len(statics) > 1:
            raise ValueError("quantization_config: groups mix static and dynamic activation scales")
        return cls(prequantized=True, static_input=statics == {True}, ignore=tuple(qc.get("ignore") or ()))

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint left `module` (its HF name) unquantized: named, or matched by
        an `re:` pattern, as compressed-tensors writes its ignore list."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module):
                    return True
            elif module == entry or module.removeprefix("model.") == entry.removeprefix("model."):
                return True
        return False


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (float8 (N, K), scales (N, 1) float32): one scale per output channel."""
    return quantize_fp8(w)


class Fp8Method(LinearMethod):
    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: Linear) -> None:
        layer.add_param("weight", torch.empty(layer.output_size, layer.input_size, dtype=FP8),
                        ParamLayout(output_dim=0, input_dim=1))
        layer.add_param("weight_scale", torch.empty(layer.output_size, 1, dtype=torch.float32),
                        ParamLayout(output_dim=0))
        if self.scheme.static_input:
            layer.add_param("input_scale", torch.empty(len(layer.output_sizes), dtype=torch.float32),
                            ParamLayout(per_shard=True))
        layer.static_scale = None  # (1,) float32 once loaded, with static activation scales

    def load(self, layer: Linear, kind: str, source: WeightSource, name: str, shard: int) -> dict[str, int]:
        if kind == "weight":
            region = layer.region("weight", shard, name)
            w = region.read(source, name)
            if w.dtype == FP8:
                if not self.scheme.prequantized:
                    raise ValueError(f"weight {name!r} is float8 but the checkpoint has no quantization_config")
                region.dest.copy_(w)
                return {"weight": region.dest.numel()}
            if self.scheme.prequantized:
                raise ValueError(f"weight {name!r} is {w.dtype}, but the checkpoint's quantization_config says float8")
            q, scales = quantize_weight(w.to(region.dest.device))
            region.dest.copy_(q)
            scale_dest = layer.region("weight_scale", shard, name).dest
            scale_dest.copy_(scales)
            return {"weight": region.dest.numel(), "weight_scale": scale_dest.numel()}
        if kind == "weight_scale" and source.shape in ((), (1,)):  # per tensor: over all its rows
            dest = layer.region("weight_scale", shard, name).dest
            dest.fill_(float(source.read().reshape(())))
            return {"weight_scale": dest.numel()}
        if kind == "input_scale" and self.scheme.static_input:
            if source.shape not in ((), (1,)):
                raise ValueError(f"weight {name!r} has shape {tuple(source.shape)}, the model expects one scale")
            layer.input_scale.data[shard] = source.read().reshape(())
            return {"input_scale": 1}
        return super().load(layer, kind, source, name, shard)

    def process_after_loading(self, layer: Linear) -> None:
        if self.scheme.static_input:
            layer.static_scale = layer.input_scale.max().reshape(1)

    def fill_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        w = torch.empty(layer.weight.shape, dtype=layer.dtype, device=layer.weight.device)
        q, scales = quantize_weight(w.normal_(0.0, 0.02, generator=generator))
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scales)
        if self.scheme.static_input:
            layer.input_scale.data.fill_(0.02)
        if layer.bias is not None:
            layer.bias.data.zero_()

    def normed_input(self, layer: Linear, ops: Ops, x: torch.Tensor | None, residual: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> QuantizedInput:
        if x is None:
            return QuantizedInput(*ops.rms_norm_fp8(residual, weight, eps, layer.static_scale))
        return QuantizedInput(*ops.fused_add_rms_norm_fp8(x, residual, weight, eps, layer.static_scale))

    def activated_input(self, layer: Linear, ops: Ops, gate_up: torch.Tensor) -> QuantizedInput:
        return QuantizedInput(*ops.silu_and_mul_fp8(gate_up, layer.static_scale))

    def prepared_input(self, layer: Linear, ops: Ops, x: torch.Tensor) -> QuantizedInput:
        return QuantizedInput(*ops.quantize_fp8(x, layer.static_scale))

    def apply(self, layer: Linear, x: torch.Tensor | QuantizedInput) -> torch.Tensor:
        if not isinstance(x, QuantizedInput):
            x = QuantizedInput(*quantize_fp8(x, layer.static_scale))
        if x.data.is_cuda:
            fp8_gemv = _gemv()
            if fp8_gemv is not None and x.data.shape[0] <= fp8_gemv.MAX_ROWS:
                return fp8_gemv.fp8_gemv(x.data, x.scales, layer.weight, layer.weight_scale, layer.bias, layer.dtype)
            # weight.t() is (K, N) column-major, as cuBLASLt wants its second operand
            return torch._scaled_mm(x.data, layer.weight.t(), scale_a=x.scales, scale_b=layer.weight_scale.t(),
                                    bias=layer.bias, out_dtype=layer.dtype)
        return F.linear(x.dequantize(layer.dtype), self.dequantized_weight(layer).to(layer.dtype), layer.bias)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale
