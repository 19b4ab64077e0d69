"""What every paged-attention kernel launch is given: the checked tensors and what the launcher
derived from them once per call (`launcher.paged_attention_with`)."""

from __future__ import annotations

from typing import NamedTuple

import torch


# a NamedTuple, not a frozen dataclass: it is built on every eager call, and a frozen dataclass's
# __init__ costs about a microsecond more
class LaunchArgs(NamedTuple):
    out: torch.Tensor  # (num_tokens, num_heads, head_dim), unit stride in head_dim
    q: torch.Tensor  # (num_tokens, num_heads, head_dim), unit stride in head_dim
    k_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim), unit stride in head_dim
    v_cache: torch.Tensor  # as k_cache
    kv_scales: torch.Tensor | None  # (2,) float32 (k_scale, v_scale) when the caches hold FP8, else None
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, unit stride in its last dim
    seq_lens: torch.Tensor  # (num_seqs,) int32 contiguous
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32 contiguous
    scale_log2: float  # softmax scale times log2(e): the kernels exponentiate in base 2
    precision: str  # tl.dot input_precision: "ieee" for float32 tensors, else "tf32"
    group: int  # query heads per KV head
    d_pad: int  # head_dim rounded up to a power of two >= 16 (a tl.dot dimension)
    # k_cache strides (block, slot, head), v_cache strides (block, slot, head), block_tables row
    cache_strides: tuple[int, ...]

    @property
    def kv_fp8(self) -> bool:
        return self.kv_scales is not None

    @property
    def scales_arg(self) -> torch.Tensor:
        """What the kernels' kv_scales pointer gets: the scales, or any tensor where unread."""
        return self.seq_lens if self.kv_scales is None else self.kv_scales
