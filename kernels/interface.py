"""The op interface the model calls, whatever implementation `ops.select` picked.

Per step the runner calls `plan` once and passes the plan to every layer's attention ops; the
norms need none. Layouts are those of `reference.py` and `step_plan.py`. The cache ops take the
layer's `kv_scales` (`kv_quant.py`), which they use when the caches hold FP8.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvpilot.kernels.step_plan import AttentionInputs, StepPlan


class Ops(ABC):
    def plan(self, meta: AttentionInputs, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
             block_size: int) -> StepPlan:
        """The plan of one step: its metadata, token positions, the model's rotary table and the
        caches' block size."""
        return StepPlan(positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                        meta.max_query_len, cos_sin_cache, block_size)

    def for_graphs(self) -> Ops:
        """The ops to record into a CUDA graph in place of these (the same, unless an
        implementation picks other kernels for launches that a graph replays)."""
        return self

    @abstractmethod
    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan,
                        scale: float, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of each sequence's new tokens q (T, H, D) over its cached context."""

    @abstractmethod
    def write_kv_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       plan: StepPlan, kv_scales: torch.Tensor | None = None) -> None:
        """Scatter the new tokens' keys and values (T, Hk, D) into their cache slots, in place."""

    @abstractmethod
    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, plan: StepPlan) -> None:
        """Rotate q (T, H, D) and k (T, Hk, D) in place by their tokens' positions."""

    def rotary_and_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, plan: StepPlan, kv_scales: torch.Tensor | None = None) -> None:
        """`rotary_embedding`, then `write_kv_cache` of the rotated k and v: what each layer does
        before attention (an implementation may fuse the two)."""
        self.rotary_embedding(q, k, plan)
        self.write_kv_cache(k, v, k_cache, v_cache, plan, kv_scales)

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, 2I), the gate and up projections side by side -> silu(gate) * up, (T, I)."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x (T, hidden) -> normalised copy, computed in float32."""

    @abstractmethod
    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> None:
        """In place: residual += x, then x = rms_norm(residual) * weight."""

    # FP8 activations for FP8 linear layers: each returns (q (T, K) float8_e4m3fn, scales (T, 1)
    # float32), q * scales ~ the values, as `reference.quantize_fp8` quantizes: per token (the row's
    # largest magnitude / 448), or the layer's static `scale` (1,) float32 for every row when given.

    @abstractmethod
    def quantize_fp8(self, x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, K) quantized."""

    @abstractmethod
    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`rms_norm(x)` (rounded to x's dtype), quantized."""

    @abstractmethod
    def fused_add_rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x in place, then `rms_norm(residual)` quantized; x is left as it was."""

    @abstractmethod
    def silu_and_mul_fp8(self, x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`silu_and_mul(x)` (rounded to x's dtype), quantized."""
