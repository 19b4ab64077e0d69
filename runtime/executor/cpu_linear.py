"""Linear layers with weights pre-packed for oneDNN, for the CPU engine.

A decode step multiplies a few rows (one per running sequence) by every weight matrix, so it is
bound by reading the weights. Through `F.linear` such a product reads a cold weight at well under
the memory's rate (the GEMM library appears to re-pack the weight on every call); packed once for
oneDNN it does not (benchmarks/history/2026-12-03.md, "Engine core on CPU"). The packed
product is not bit-identical to `F.linear` (the blocked kernel sums in another order: relative
differences near 4e-7 in fp32).

`pack_linears` gives every quantized-linear layer (`quant.Linear`) a packed copy of the weight its
method multiplies by (a plain weight itself, which the packed copy then replaces so memory does
not grow; a quantized one de-quantized, beside the quantized parameters the CPU path emulates),
and the output head a packed copy (beside the embedding table, when tied). It does nothing where
oneDNN is unavailable.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.kernels.ops import Ops
from kvpilot.runtime.executor.quant.base import Linear, LinearMethod, QuantizedInput
from kvpilot.runtime.executor.quant.unquantized import UnquantizedMethod

PACKED_DTYPES = (torch.float32,)


def packing_available(dtype: torch.dtype) -> bool:
    return (dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """y = x W^T + b for 2-D x, with W held in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # the hint picks the blocking; 16..256 rows all ran within noise of each other at 1-864 rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), max(16, min(rows_hint, 256)))
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


class PackedMethod(LinearMethod):
    """A loaded layer's method with its product taken over by a packed de-quantized weight; the
    quantized method still makes the layer's input (quantized activations de-quantize here)."""

    def __init__(self, inner: LinearMethod, packed: PackedLinear) -> None:
        self.inner, self.packed = inner, packed

    def create_weights(self, layer: Linear) -> None:
        raise TypeError("a packed method wraps a loaded layer's; it creates no weights")

    def apply(self, layer: Linear, x: torch.Tensor | QuantizedInput) -> torch.Tensor:
        return self.packed(x.dequantize(layer.dtype) if isinstance(x, QuantizedInput) else x)

    def normed_input(self, layer: Linear, ops: Ops, x: torch.Tensor | None, residual: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> torch.Tensor | QuantizedInput:
        return self.inner.normed_input(layer, ops, x, residual, weight, eps)

    def activated_input(self, layer: Linear, ops: Ops, gate_up: torch.Tensor) -> torch.Tensor | QuantizedInput:
        return self.inner.activated_input(layer, ops, gate_up)

    def prepared_input(self, layer: Linear, ops: Ops, x: torch.Tensor) -> torch.Tensor | QuantizedInput:
        return self.inner.prepared_input(layer, ops, x)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        return self.inner.dequantized_weight(layer)


def pack_linears(model: nn.Module, rows_hint: int) -> bool:
    """Pack the model's linear layers, in place; False when not possible."""
    first = next(model.parameters())
    if first.device.type != "cpu" or not packing_available(first.dtype):
        return False
    for layer in list(model.modules()):
        if isinstance(layer, Linear) and not isinstance(layer.method, PackedMethod):
            weight = layer.method.dequantized_weight(layer).to(layer.dtype)
            layer.method = PackedMethod(layer.method, PackedLinear(weight, layer.bias, rows_hint))
            if isinstance(layer.method.inner, UnquantizedMethod):
                del layer.weight  # the packed copy is the only one the product reads
    lm_head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    if isinstance(lm_head, nn.Linear):
        model.lm_head = PackedLinear(lm_head.weight, lm_head.bias, rows_hint)
    elif lm_head is None and isinstance(embed, nn.Embedding):
        model.lm_head = PackedLinear(embed.weight, None, rows_hint)  # tied embeddings
    return True
