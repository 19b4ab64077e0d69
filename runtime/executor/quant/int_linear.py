"""What AWQ and GPTQ share (`awq.py`, `gptq.py`): the checkpoint's tensors are read as saved,
converted once after loading into kvpilot's packed layout (`kvpilot.kernels.int_gemm.IntWeight`),
which replaces them, and multiplied by the Triton kernels that de-quantise in their inner loop on
CUDA; elsewhere by de-quantised compute (the torch twin; on the CPU engine `cpu_linear.py` packs
the de-quantised weight once for oneDNN).

Random weights (`--load-format dummy`) are an RTN quantisation (`rtn.py`) of HF's normal(0, 0.02)
init written in the format's own on-disk layout, so they take the same conversion as a checkpoint.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from kvpilot.kernels.int_gemm import IntWeight, dequantize, int_linear_reference
from kvpilot.runtime.executor.quant.base import Linear, LinearMethod, QuantizedInput

# the packed layout's tensors, held by the layer under these names once converted
PACKED = ("qweight", "scales", "zeros", "perm")
DUMMY_GROUP_SIZES = (128, 64, 32)


def dummy_group_size(in_features: int) -> int:
    """Random weights' group size: the most common one (128) where it divides the inputs, else the
    largest of DUMMY_GROUP_SIZES that does, else one group."""
    return next((g for g in DUMMY_GROUP_SIZES if in_features % g == 0), in_features)


class IntLinearMethod(LinearMethod):
    """A format of integer weights: creates and fills its on-disk tensors (subclasses), converts
    them (`to_int_weight`) and multiplies."""

    @abstractmethod
    def to_int_weight(self, layer: Linear) -> IntWeight:
        """The layer's loaded on-disk tensors in kvpilot's layout, scales in the model's dtype."""

    @abstractmethod
    def on_disk(self, layer: Linear, dense: torch.Tensor) -> dict[str, torch.Tensor]:
        """An RTN quantisation of dense (N, K) float32 as the layer's format stores it (dummy weights)."""

    def process_after_loading(self, layer: Linear) -> None:
        w = self.to_int_weight(layer)
        for kind in list(layer.layouts):
            if kind != "bias":
                delattr(layer, kind)
                del layer.layouts[kind]
        for kind, t in zip(PACKED, (w.qweight, w.scales, w.zeros, w.perm), strict=True):
            if t is not None:
                layer.register_parameter(kind, nn.Parameter(t, requires_grad=False))
        layer.int_weight = w

    def fill_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        device = layer.qweight.device
        dense = torch.empty(layer.output_size, layer.input_size, device=device).normal_(0.0, 0.02, generator=generator)
        for kind, t in self.on_disk(layer, dense).items():
            getattr(layer, kind).data.copy_(t)
        if layer.bias is not None:
            layer.bias.data.zero_()

    def apply(self, layer: Linear, x: torch.Tensor | QuantizedInput) -> torch.Tensor:
        if isinstance(x, QuantizedInput):
            raise TypeError("integer-weight layers take activations as they are, not quantized")
        w: IntWeight = layer.int_weight
        if x.is_cuda:  # the kernels import Triton: on CUDA only (the package's note)
            from kvpilot.kernels.int_gemm import int_gemm

            out = int_gemm(x, w)
        else:
            out = int_linear_reference(x, w)
        return out if layer.bias is None else out.add_(layer.bias)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        return dequantize(layer.int_weight, torch.float32)
