"""The Triton implementation of the ops (same layouts as `reference.py`); each kernel lives in
its own module, and this class calls their checked launchers with the step plan's tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.kernels import activation, cache, fp8_quant, norm, rotary
from kvpilot.kernels.interface import Ops
from kvpilot.kernels.paged_attention import launcher
from kvpilot.kernels.step_plan import StepPlan


@dataclass(frozen=True)
class TritonOps(Ops):
    """prefer_tma: paged attention takes the TMA decode kernel wherever it can read the caches
    (`paged_attention/tma_decode.py`); graphs_prefer_tma: the same for the ops recorded into CUDA
    graphs (`for_graphs`). `ops.select` sets both from KVPILOT_DECODE_TMA."""

    prefer_tma: bool = False
    graphs_prefer_tma: bool = True

    def for_graphs(self) -> TritonOps:
        return TritonOps(prefer_tma=self.graphs_prefer_tma, graphs_prefer_tma=self.graphs_prefer_tma)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan,
                        scale: float, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        return launcher.paged_attention(q, k_cache, v_cache, plan.block_tables, plan.seq_lens,
                                        plan.query_start_loc, scale, plan.max_query_len,
                                        prefer_tma=self.prefer_tma, kv_scales=kv_scales)

    def write_kv_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       plan: StepPlan, kv_scales: torch.Tensor | None = None) -> None:
        cache.write_kv_cache(k, v, k_cache, v_cache, plan.slot_mapping, kv_scales)

    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, plan: StepPlan) -> None:
        rotary.rotary_embedding(plan.positions, q, k, plan.cos_sin_cache)

    def rotary_and_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, plan: StepPlan, kv_scales: torch.Tensor | None = None) -> None:
        rotary.rotary_and_write_kv(plan.positions, q, k, plan.cos_sin_cache, v, k_cache, v_cache, plan.slot_mapping,
                                   kv_scales)

    silu_and_mul = staticmethod(activation.silu_and_mul)
    rms_norm = staticmethod(norm.rms_norm)
    fused_add_rms_norm = staticmethod(norm.fused_add_rms_norm)
    quantize_fp8 = staticmethod(fp8_quant.quantize_fp8)
    rms_norm_fp8 = staticmethod(norm.rms_norm_fp8)
    fused_add_rms_norm_fp8 = staticmethod(norm.fused_add_rms_norm_fp8)
    silu_and_mul_fp8 = staticmethod(fp8_quant.silu_and_mul_fp8)
