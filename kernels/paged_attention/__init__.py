"""Paged attention for a varlen batch that mixes decode, prefill and chunked prefill.

Layouts are those of `kernels/reference.py`: q/out (num_tokens, num_heads, head_dim);
k_cache/v_cache (num_blocks, block_size, num_kv_heads, head_dim) with unit stride in head_dim
(other strides are passed to the kernels, so token-major and head-major caches both work);
block_tables (num_seqs, max_blocks) int32; seq_lens (num_seqs,) int32; query_start_loc
(num_seqs + 1,) int32. A sequence's query rows are its last q_len positions.

Modules, one concept each:
* `launcher.py`: argument checks and which kernels serve a batch (the entry points below);
* `pointer_decode.py`: decode through per-token block-id loads, split-KV and its reduce;
* `tma_decode.py`: decode through TMA bulk copies of head-major cache blocks (Hopper and later);
* `prefill.py`: flash-attention tiles for sequences with several new tokens;
* `tiles.py`: the online-softmax device functions the pointer decode and prefill kernels share;
* `launch_args.py`: what each kernel launch is given.
Terms: "GQA packing" puts a KV head's group of query heads into the rows of one tile, so each
K/V tile is read once per group; "split-KV" gives slices of a long context to several programs.
"""

from kvpilot.kernels.paged_attention.launcher import (
           paged_attention,
           paged_attention_with,
           split_probe_widths,
)
from kvpilot.kernels.paged_attention.pointer_decode import DecodeConfig
from kvpilot.kernels.paged_attention.prefill import PrefillConfig
from kvpilot.kernels.paged_attention.tma_decode import TmaDecodeConfig

__all__ = ["DecodeConfig", "PrefillConfig", "TmaDecodeConfig", "paged_attention", "paged_attention_with",
           "split_probe_widths"]
