"""AWQ checkpoints (`--quantization awq`): AutoAWQ's GEMM layout (`int_layouts.py`), 4-bit with zero
points and group-wise float16 scales, read as saved and served by the integer kernels
(`int_linear.py`).

A config.json names it as AutoAWQ writes it: `quantization_config: {quant_method: awq, bits: 4,
group_size: 128, zero_point: true, version: gemm, modules_to_not_convert: [...]}` (older files
spell them w_bit and q_group_size). Other AWQ variants (GEMV's packing, no zero points) are refused
with the field that says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.kernels.int_gemm import IntWeight
from kvpilot.runtime.executor.quant.base import Linear, ParamLayout
from kvpilot.runtime.executor.quant.int_layouts import AWQ_BITS, awq_tensors, awq_to_int_weight
from kvpilot.runtime.executor.quant.int_linear import IntLinearMethod, dummy_group_size
from kvpilot.runtime.executor.quant.rtn import rtn_quantize

PACK = 32 // AWQ_BITS


@dataclass(frozen=True)
class AwqScheme:
    group_size: int | None  # None: random weights (int_linear.dummy_group_size)
    skip: tuple[str, ...] = ()  # modules_to_not_convert: modules whose names contain one stay plain

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> AwqScheme:
        qc = hf_config.get("quantization_config") or {}
        if not qc:
            return cls(None)
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != AWQ_BITS:
            raise ValueError(f"quantization_config: AWQ bits {bits!r} is not served (4-bit only)")
        if qc.get("zero_point", True) is not True:
            raise ValueError("quantization_config: AWQ without zero points (zero_point: false) is not served")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config: AWQ version {version!r} is not served (gemm only)")
        group = qc.get("group_size", qc.get("q_group_size"))
        if not isinstance(group, int) or group <= 0:
            raise ValueError(f"quantization_config: AWQ group_size {group!r} must be a positive integer")
        return cls(group, tuple(qc.get("modules_to_not_convert") or ()))

    def skips(self, module: str) -> bool:
        return any(part in module for part in self.skip)


class AwqMethod(IntLinearMethod):
    def __init__(self, scheme: AwqScheme) -> None:
        self.scheme = scheme

    def group_size(self, layer: Linear) -> int:
        k = layer.input_size
        if self.scheme.group_size is None:
            return dummy_group_size(k)
        if k % self.scheme.group_size:
            raise ValueError(f"AWQ group_size {self.scheme.group_size} does not divide this rank's {k} inputs")
        return self.scheme.group_size

    def create_weights(self, layer: Linear) -> None:
        k, g = layer.input_size, self.group_size(layer)
        if any(n % PACK for n in layer.output_sizes):
            raise ValueError(f"AWQ packs {PACK} outputs per word: output sizes {layer.output_sizes} must be multiples")
        n = layer.output_size
        layer.add_param("qweight", torch.empty(k, n // PACK, dtype=torch.int32),
                        ParamLayout(output_dim=1, input_dim=0, output_pack=PACK))
        layer.add_param("qzeros", torch.empty(k // g, n // PACK, dtype=torch.int32),
                        ParamLayout(output_dim=1, input_dim=0, output_pack=PACK, input_pack=g))
        layer.add_param("scales", torch.empty(k // g, n, dtype=torch.float16),
                        ParamLayout(output_dim=1, input_dim=0, input_pack=g))
        layer.group_size = g

    def to_int_weight(self, layer: Linear) -> IntWeight:
        return awq_to_int_weight(layer.qweight, layer.qzeros, layer.scales, layer.group_size, layer.dtype)

    def on_disk(self, layer: Linear, dense: torch.Tensor) -> dict[str, torch.Tensor]:
        return awq_tensors(rtn_quantize(dense, AWQ_BITS, layer.group_size, symmetric=False))
