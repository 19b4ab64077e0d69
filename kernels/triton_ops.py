"""The Triton implementation of the ops in `ops.py` (same signatures and layouts as
`reference.py`); each kernel lives in its own module."""

from kvpilot.kernels.cache import write_kv_cache
from kvpilot.kernels.norm import fused_add_rms_norm, rms_norm
from kvpilot.kernels.paged_attention import paged_attention
from kvpilot.kernels.rotary import rotary_embedding

__all__ = ["fused_add_rms_norm", "paged_attention", "rms_norm", "rotary_embedding", "write_kv_cache"]
