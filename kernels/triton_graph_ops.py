"""The Triton ops as recorded into decode CUDA graphs (`ops.for_graphs`): those of `triton_ops`,
with paged attention told it is being captured, so that it takes the TMA decode kernel where it
can (its launch encodes two tensor maps on the host, which a replay skips)."""

from functools import partial

from kvpilot.kernels.paged_attention import paged_attention as _paged_attention
from kvpilot.kernels.triton_ops import (
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    write_kv_cache,
)

paged_attention = partial(_paged_attention, in_graph=True)

__all__ = ["fused_add_rms_norm", "paged_attention", "rms_norm", "rotary_embedding", "write_kv_cache"]
