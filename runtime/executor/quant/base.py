"""The `Linear` layer and the `LinearMethod` interface it delegates to (the package docstring
describes both); `QuantizedInput` is an activation already quantized by the op before the layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from kvpilot.kernels.ops import Ops
from kvpilot.runtime.executor.parallel import TPInfo

Parallel = Literal["column", "row"]


class WeightSource(Protocol):
    """A checkpoint tensor that can be read in part (safetensors slices read only what is asked)."""

    shape: tuple[int, ...]

    def read(self, dim: int | None = None, start: int = 0, length: int = 0) -> torch.Tensor: ...


@dataclass(frozen=True)
class QuantizedInput:
    """Activations quantized for the next layer: data (T, K) in the method's number format,
    scales (T, 1) float32, one per token (a static scale repeated), data * scales = the values."""

    data: torch.Tensor
    scales: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.data.float() * self.scales).to(dtype)


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter's dims run (package docstring)."""

    output_dim: int | None = None
    input_dim: int | None = None
    output_pack: int = 1
    input_pack: int = 1
    per_shard: bool = False


@dataclass(frozen=True)
class Region:
    """This rank's part of one checkpoint tensor: its expected full shape, what to read (`dim`
    None: all of it) and the parameter view it goes to."""

    shape: tuple[int, ...]
    dim: int | None
    start: int
    length: int
    dest: torch.Tensor

    def read(self, source: WeightSource, name: str) -> torch.Tensor:
        if tuple(source.shape) != self.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(source.shape)}, the model expects {self.shape}")
        return source.read() if self.dim is None else source.read(self.dim, self.start, self.length)


class LinearMethod(ABC):
    """How one weight format stores, loads and multiplies a linear layer's weights."""

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Register the layer's parameters (`layer.add_param`), on the current default device."""

    def load(self, layer: Linear, kind: str, source: WeightSource, name: str, shard: int) -> dict[str, int]:
        """Copy this rank's part of the checkpoint tensor `name` (its last part `kind`) into the
        layer; returns the elements filled, by parameter kind."""
        region = layer.region(kind, shard, name)
        region.dest.copy_(region.read(source, name))
        return {kind: region.dest.numel()}

    def process_after_loading(self, layer: Linear) -> None:  # noqa: B027 (most methods need no last step)
        """Once, after every checkpoint tensor is in."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor | QuantizedInput) -> torch.Tensor:
        """x (T, input_size) -> (T, sum(output_sizes)) in the model's dtype, bias added."""

    def normed_input(self, layer: Linear, ops: Ops, x: torch.Tensor | None, residual: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> torch.Tensor | QuantizedInput:
        """This layer's input from an RMSNorm: of `residual` alone (x None), else residual += x
        first (in place) as `ops.fused_add_rms_norm`."""
        if x is None:
            return ops.rms_norm(residual, weight, eps)
        ops.fused_add_rms_norm(x, residual, weight, eps)
        return x

    def activated_input(self, layer: Linear, ops: Ops, gate_up: torch.Tensor) -> torch.Tensor | QuantizedInput:
        """This layer's input from SwiGLU's activation of gate_up (T, 2I)."""
        return ops.silu_and_mul(gate_up)

    def prepared_input(self, layer: Linear, ops: Ops, x: torch.Tensor) -> torch.Tensor | QuantizedInput:
        """This layer's input from any other op's output x (T, input_size): attention's, ahead of o."""
        return x

    @abstractmethod
    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        """(sum(output_sizes), input_size) float32: the weight `apply` multiplies by."""

    def fill_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        """Random weights as HF initialises them (normal, std 0.02), zero biases."""
        weight, bias = layer.get_parameter("weight"), layer.bias
        weight.data.normal_(0.0, 0.02, generator=generator)
        if bias is not None:
            bias.data.zero_()


class Linear(nn.Module):
    """y = x W^T + b for one layer, or a fused one (`output_sizes` per shard, side by side),
    column- or row-parallel under tensor parallelism. Sizes are this rank's."""

    bias: nn.Parameter | None

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool, parallel: Parallel,
                 tp: TPInfo, method: LinearMethod) -> None:
        super().__init__()
        self.input_size, self.output_sizes = input_size, list(output_sizes)
        self.output_size = sum(output_sizes)
        self.parallel, self.tp, self.method = parallel, tp, method
        self.dtype = torch.get_default_dtype()  # the model's: activations in and out
        self.layouts: dict[str, ParamLayout] = {}
        self.register_parameter("bias", None)
        method.create_weights(self)
        if bias:
            self.add_param("bias", torch.empty(self.output_size), ParamLayout(output_dim=0))

    def add_param(self, kind: str, data: torch.Tensor, layout: ParamLayout) -> None:
        self.register_parameter(kind, nn.Parameter(data, requires_grad=False))
        self.layouts[kind] = layout

    def region(self, kind: str, shard: int, name: str) -> Region:
        """Where this rank's part of checkpoint tensor `name` (parameter `kind`, fused shard
        `shard`) comes from and goes to."""
        param = getattr(self, kind, None)
        layout = self.layouts.get(kind)
        if not isinstance(param, nn.Parameter) or layout is None:
            raise ValueError(f"unexpected weight {name!r}: the layer has no {kind!r}")
        dest = param.data[shard] if layout.per_shard else param.data
        shape = list(dest.shape)
        if self.parallel == "column" and layout.output_dim is not None and not layout.per_shard:
            dim, pack = layout.output_dim, layout.output_pack
            length = self.output_sizes[shard] // pack
            dest = dest.narrow(dim, sum(self.output_sizes[:shard]) // pack, length)
        elif self.parallel == "row" and layout.input_dim is not None:
            dim, length = layout.input_dim, self.input_size // layout.input_pack
        else:
            return Region(tuple(shape), None, 0, 0, dest)
        shape[dim] = length * self.tp.size
        if self.tp.size == 1:
            return Region(tuple(shape), None, 0, 0, dest)
        return Region(tuple(shape), dim, self.tp.rank * length, length, dest)

    def forward(self, x: torch.Tensor | QuantizedInput) -> torch.Tensor:
        return self.method.apply(self, x)

    def normed_input(self, ops: Ops, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor | QuantizedInput:
        return self.method.normed_input(self, ops, x, residual, weight, eps)

    def activated_input(self, ops: Ops, gate_up: torch.Tensor) -> torch.Tensor | QuantizedInput:
        return self.method.activated_input(self, ops, gate_up)

    def prepared_input(self, ops: Ops, x: torch.Tensor) -> torch.Tensor | QuantizedInput:
        return self.method.prepared_input(self, ops, x)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_sizes={self.output_sizes}, parallel={self.parallel}, "
                f"method={type(self.method).__name__}")
