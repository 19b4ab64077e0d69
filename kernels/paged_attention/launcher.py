"""Host side of paged attention: argument checks, then which kernels serve a batch.

A decode kernel (`pointer_decode.py`, or `tma_decode.py` where asked for and possible) takes the
sequences with q_len == 1 and the prefill kernel (`prefill.py`) those with more, with no host
synchronisation. Without a sync the launcher cannot tell an all-decode batch from one with as
many tokens as sequences where some are empty and others long; when the caller passes
max_query_len (the engine does) it knows. When it does not and num_tokens == num_seqs, only the
decode kernel runs, built with MULTI, which loops over any q_len.
"""

from __future__ import annotations

import torch

from kvpilot.kernels.checks import (
    CACHE_DTYPES,
    FLOAT_DTYPES,
    check_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from kvpilot.kernels.host import INTERPRETING, cdiv, next_power_of_2
from kvpilot.kernels.kv_quant import check_scales
from kvpilot.kernels.paged_attention import pointer_decode, tma_decode
from kvpilot.kernels.paged_attention import prefill as prefill_kernel
from kvpilot.kernels.paged_attention.launch_args import LaunchArgs
from kvpilot.kernels.paged_attention.pointer_decode import (
    MULTI_DECODE,
    DecodeConfig,
    choose_num_splits,
)
from kvpilot.kernels.paged_attention.prefill import PrefillConfig
from kvpilot.kernels.paged_attention.tiles import LOG2E
from kvpilot.kernels.paged_attention.tma_decode import TmaDecodeConfig

MAX_GROUP = 16
MAX_HEAD_DIM = 128


def check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, kv_scales: torch.Tensor | None = None,
) -> None:
    """The layouts every kernel here assumes (`launch_args.LaunchArgs`), as ValueErrors naming
    the argument. The caches hold q's dtype, or FP8 with kv_scales (`kv_quant.check_scales`)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, CACHE_DTYPES, q.device)
    check_tensor("v_cache", v_cache, 4, CACHE_DTYPES, q.device)
    check_same_dtype("v_cache", v_cache, "k_cache", k_cache)
    if check_scales(kv_scales, k_cache) is None:
        check_same_dtype("k_cache", k_cache, "q", q)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache head_dim {cache_head_dim} differs from q head_dim {head_dim}")
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 up to {MAX_HEAD_DIM}, got {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of 2, got {block_size}")
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}) at most {MAX_GROUP} times larger")
    check_tensor("block_tables", block_tables, 2, (torch.int32,), q.device)
    num_seqs = block_tables.shape[0]
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), q.device)
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,), q.device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_contiguous("seq_lens", seq_lens)
    check_contiguous("query_start_loc", query_start_loc)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int | None = None,
    *, prefer_tma: bool = False, kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.
    `max_query_len` (the longest sequence's new tokens, known to the caller without a sync) lets
    an all-decode batch run the decode kernel built for one token per sequence.
    `prefer_tma` takes the TMA decode kernel wherever it can read the caches
    (`tma_decode.unsupported`); the Triton ops set it for launches recorded into CUDA graphs, where
    a replay skips the host work that makes its launch dearer than the pointer kernel's.
    `kv_scales` (k_scale, v_scale) de-quantise caches that hold FP8 (kvpilot.kernels.kv_quant);
    caches of q's dtype ignore them."""
    check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, kv_scales)
    if max_query_len is not None and not 0 <= max_query_len <= q.shape[0]:
        raise ValueError(f"max_query_len must be between 0 and num_tokens ({q.shape[0]}), got {max_query_len}")
    return paged_attention_with(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                max_query_len=max_query_len, use_tma=None if prefer_tma else False,
                                kv_scales=kv_scales)


def _default_decode(multi: bool) -> DecodeConfig:
    # the interpreter's small tiles keep CPU runs short
    if INTERPRETING:
        return DecodeConfig(block_n=16, num_stages=1, min_split=16)
    return MULTI_DECODE if multi else DecodeConfig()


def _num_splits(num_seqs: int, num_kv_heads: int, max_context: int, decode: DecodeConfig,
                device: torch.device, num_splits: int | None = None) -> int:
    """The context slices of a decode launch (each sequence cuts its own context into them:
    pointer_decode._slice_len); no more than max_context has of decode.min_split tokens."""
    if num_splits is None:
        return choose_num_splits(num_seqs, num_kv_heads, max_context, device, decode.min_split)
    return max(1, min(num_splits, cdiv(max_context, decode.min_split)))


def split_probe_widths(num_kv_heads: int, block_size: int, max_blocks: int, device: torch.device) -> list[int]:
    """Block-table widths (in blocks, up to `max_blocks`) at which a step of one sequence with one
    new token launches each split variant that any step on caches of `block_size` can: split-KV
    builds its decode kernel once and its reduce kernel once per power of two of slices, and one
    sequence reaches every count that more sequences do (the launcher splits less as programs
    grow), down to none at all (a context of one block, up to min_split tokens). A start-up probe
    runs one such step per width, so that no step compiles one mid-run."""
    decode = _default_decode(multi=False)
    seen: set[int] = set()
    widths = []
    for width in range(1, max_blocks + 1):
        num_splits = _num_splits(1, num_kv_heads, width * block_size, decode, device)
        variant = next_power_of_2(num_splits) if num_splits > 1 else 1
        if variant not in seen:
            seen.add(variant)
            widths.append(width)
    return widths


def paged_attention_with(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
    max_query_len: int | None = None, num_splits: int | None = None, decode: DecodeConfig | None = None,
    prefill: PrefillConfig | None = None, out: torch.Tensor | None = None,
    use_tma: bool | None = False, tma: TmaDecodeConfig | None = None, kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` without the argument checks and with the tuning knobs exposed
    (benchmarks and tests pick them, tests pass a poisoned `out`; the engine takes defaults).
    use_tma runs the single-token sequences through the TMA decode kernel (Hopper or later, caches
    as tma_decode.unsupported says) when max_query_len is given and the context is not split:
    True asks for it (ValueError where it cannot read the caches), None takes it where it can,
    False never does. `tma` defaults to tma_decode.DEFAULTS for the cache's block size. FP8 caches
    need their kv_scales, which other caches ignore."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # float32 caches get float32 products: Triton's default for a float32 dot is tf32 (~3e-4)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    args = LaunchArgs(out, q, k_cache, v_cache, check_scales(kv_scales, k_cache), block_tables, seq_lens,
                      query_start_loc, scale * LOG2E,
                      precision, num_heads // num_kv_heads, max(16, next_power_of_2(head_dim)),
                      (*k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0)))
    # as many tokens as sequences: all decode, unless some sequence is empty and another has
    # several tokens; without max_query_len to rule that out, the decode kernel covers any q_len
    # (MULTI) and the prefill kernel does not run
    all_decode = num_tokens == num_seqs if max_query_len is None else max_query_len <= 1
    multi = all_decode and max_query_len is None
    decode = decode or _default_decode(multi)
    max_context = block_tables.shape[1] * block_size  # an upper bound known without a sync
    num_splits = _num_splits(num_seqs, num_kv_heads, max_context, decode, q.device, num_splits)
    why = "not asked for" if use_tma is False else tma_decode.unsupported(q, k_cache, v_cache)
    if use_tma and why:
        raise ValueError(f"the TMA decode kernel cannot serve these caches: {why}")
    if why is None and not multi and num_splits == 1:
        tma_decode.launch(args, tma or tma_decode.DEFAULTS[block_size])
    else:
        pointer_decode.launch(args, decode, num_splits, multi)
    if not all_decode:
        if prefill is None:
            prefill = PrefillConfig(block_m=32, block_n=16, num_stages=1) if INTERPRETING else PrefillConfig()
        prefill_kernel.launch(args, prefill)
    return out
