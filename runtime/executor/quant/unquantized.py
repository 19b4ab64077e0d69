"""The trivial method: the checkpoint's weights as they are, in the model's dtype, one GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.runtime.executor.quant.base import Linear, LinearMethod, ParamLayout, QuantizedInput


class UnquantizedMethod(LinearMethod):
    def create_weights(self, layer: Linear) -> None:
        layer.add_param("weight", torch.empty(layer.output_size, layer.input_size),
                        ParamLayout(output_dim=0, input_dim=1))

    def apply(self, layer: Linear, x: torch.Tensor | QuantizedInput) -> torch.Tensor:
        if isinstance(x, QuantizedInput):
            raise TypeError("the unquantized method takes activations as they are, not quantized")
        return F.linear(x, layer.weight, layer.bias)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        return layer.weight.float()
