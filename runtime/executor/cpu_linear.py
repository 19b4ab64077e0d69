"""Linear layers with weights pre-packed for oneDNN, for the CPU engine.

A decode step multiplies a few rows (one per running sequence) by every weight matrix, so it is
bound by reading the weights. Through `F.linear` such a product reads a cold weight at well under
the memory's rate (the GEMM library appears to re-pack the weight on every call); packed once for
oneDNN it does not (benchmarks/history/2026-12-03.md, "Engine core on CPU"). The packed
product is not bit-identical to `F.linear` (the blocked kernel sums in another order: relative
differences near 4e-7 in fp32).

`pack_linears` swaps every `nn.Linear` of a loaded model for a `PackedLinear` (the packed copy
replaces the plain weight, so memory does not grow) and gives a tied-embedding model a packed
output head beside its embedding table. It does nothing where oneDNN is unavailable.
"""

from __future__ import annotations

import torch
from torch import nn

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


def pack_linears(model: nn.Module, rows_hint: int) -> bool:
    """Replace the model's linear layers by packed ones, in place; False when not possible."""
    first = next(model.parameters())
    if first.device.type != "cpu" or not packing_available(first.dtype):
        return False
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias, rows_hint))
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", None) is None and isinstance(embed, nn.Embedding):
        model.lm_head = PackedLinear(embed.weight, None, rows_hint)  # tied embeddings
    return True
