"""GPTQ checkpoints (`--quantization gptq`): the AutoGPTQ/GPTQModel layout (`int_layouts.py`), 4- or
8-bit, symmetric or not, with or without act-order (`desc_act`), read as saved and served by the
integer kernels (`int_linear.py`).

A config.json names it as those libraries write it: `quantization_config: {quant_method: gptq,
bits, group_size (-1: one group per output), desc_act, sym, checkpoint_format: gptq | gptq_v2}`.
Refused, with the field that says so: other bit widths, a quantized LM head (`lm_head: true`),
per-module overrides (`dynamic`), Marlin's repacked layout (`is_marlin_format`), and act-order in
a layer whose inputs tensor parallelism splits (each rank would need every group's scales).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.kernels.int_gemm import IntWeight
from kvpilot.runtime.executor.quant.base import Linear, ParamLayout
from kvpilot.runtime.executor.quant.int_layouts import gptq_tensors, gptq_to_int_weight
from kvpilot.runtime.executor.quant.int_linear import IntLinearMethod, dummy_group_size
from kvpilot.runtime.executor.quant.rtn import rtn_quantize

GPTQ_BITS = (4, 8)
ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}  # added to the stored zero points


@dataclass(frozen=True)
class GptqScheme:
    bits: int = 4
    group_size: int | None = None  # -1: one group over all of a layer's inputs; None: random weights
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> GptqScheme:
        qc = hf_config.get("quantization_config") or {}
        if not qc:
            return cls()
        bits, group = qc.get("bits"), qc.get("group_size", -1)
        if bits not in GPTQ_BITS:
            raise ValueError(f"quantization_config: GPTQ bits {bits!r} is not served ({' or '.join(map(str, GPTQ_BITS))})")
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise ValueError(f"quantization_config: GPTQ group_size {group!r} must be a positive integer or -1")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ZERO_OFFSETS or qc.get("is_marlin_format"):
            raise ValueError(f"quantization_config: GPTQ checkpoint_format {'marlin' if qc.get('is_marlin_format') else fmt!r} "
                             f"is not served ({', '.join(ZERO_OFFSETS)})")
        if qc.get("lm_head"):
            raise ValueError("quantization_config: a GPTQ-quantized LM head (lm_head: true) is not served")
        if qc.get("dynamic"):
            raise ValueError("quantization_config: GPTQ per-module overrides (dynamic) are not served")
        return cls(bits, group, bool(qc.get("desc_act", False)), bool(qc.get("sym", True)), fmt)


class GptqMethod(IntLinearMethod):
    def __init__(self, scheme: GptqScheme) -> None:
        self.scheme = scheme
        self.pack = 32 // scheme.bits

    def create_weights(self, layer: Linear) -> None:
        s, k, n = self.scheme, layer.input_size, layer.output_size
        split_inputs = layer.parallel == "row" and layer.tp.size > 1
        per_channel = s.group_size == -1
        if s.desc_act and split_inputs:
            raise ValueError("GPTQ act-order (desc_act) checkpoints are served without tensor parallelism: a rank "
                             "holding a slice of a layer's inputs would need every group's scales")
        g = k if per_channel else s.group_size or dummy_group_size(k)
        if k % g or k % self.pack:
            raise ValueError(f"GPTQ group_size {g} and packing of {self.pack} must divide this rank's {k} inputs")
        if any(size % self.pack for size in layer.output_sizes):
            raise ValueError(f"GPTQ zero points pack {self.pack} outputs per word: output sizes {layer.output_sizes} "
                             "must be multiples")
        group_dim = None if per_channel else 0  # one group: every rank reads it whole
        layer.add_param("qweight", torch.empty(k // self.pack, n, dtype=torch.int32),
                        ParamLayout(output_dim=1, input_dim=0, input_pack=self.pack))
        layer.add_param("qzeros", torch.empty(k // g, n // self.pack, dtype=torch.int32),
                        ParamLayout(output_dim=1, input_dim=group_dim, output_pack=self.pack, input_pack=g))
        layer.add_param("scales", torch.empty(k // g, n, dtype=torch.float16),
                        ParamLayout(output_dim=1, input_dim=group_dim, input_pack=g))
        layer.add_param("g_idx", torch.empty(len(layer.output_sizes), k, dtype=torch.int32),
                        ParamLayout(input_dim=0, per_shard=True))
        layer.group_size = g

    def to_int_weight(self, layer: Linear) -> IntWeight:
        g_idx = layer.g_idx[0]
        if any(not torch.equal(g_idx, other) for other in layer.g_idx[1:]):
            raise ValueError("GPTQ g_idx differs between the modules kvpilot fuses into one layer (q/k/v or "
                             "gate/up), which read the same inputs in one order")
        group_of = g_idx if self.scheme.desc_act else None  # without act-order g_idx is k // group_size
        return gptq_to_int_weight(layer.qweight, layer.qzeros, layer.scales, group_of, self.scheme.bits,
                                  layer.group_size, ZERO_OFFSETS[self.scheme.checkpoint_format], layer.dtype)

    def on_disk(self, layer: Linear, dense: torch.Tensor) -> dict[str, torch.Tensor]:
        rtn = rtn_quantize(dense, self.scheme.bits, layer.group_size, self.scheme.sym)
        return gptq_tensors(rtn, self.scheme.bits, ZERO_OFFSETS[self.scheme.checkpoint_format])
