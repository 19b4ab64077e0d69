"""Paged attention over FP8 caches: every kernel path (pointer decode, split or not, the MULTI
variant, TMA decode, prefill) equals the reference, which de-quantises the caches and attends in
q's dtype, and a kernel that ignored either scale would be far off. Triton's interpreter reads
float8 exactly (it widens NaN codes wrongly, so the NaN-poisoned slots are checked on the GPU)."""

from __future__ import annotations

import math

import pytest
import torch
from paged_batches import (
    DECODE,
    MIXED,
    dense_float64,
    fp8_batch,
    head_major_batch,
    make_batch,
    rel_err,
    run_triton,
    tolerance,
)

from kvpilot.kernels import reference
from kvpilot.kernels.kv_quant import dequantize
from kvpilot.kernels.paged_attention import PrefillConfig, TmaDecodeConfig, paged_attention
from kvpilot.runtime.tunables import BLOCK_SIZES

# the caches' unit-normal values quantised well inside e4m3's range; the scales differ, so a kernel
# that swapped or dropped one is caught
K_SCALE, V_SCALE = 2.0 ** -2, 2.0 ** -4


# a decode, a chunked prefill and a prefill, small enough for the interpreter
SMALL_MIXED = [(37, 5), (20, 1), (19, 19)]


def fp8(specs: list[tuple[int, int]], block_size: int, device: torch.device, head_major: bool = False,
        num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
        q_dtype: torch.dtype = torch.float32, poison_unused: bool = False) -> tuple[tuple, torch.Tensor]:
    batch = make_batch(specs, num_heads, num_kv_heads, head_dim, block_size, q_dtype, device,
                       poison_unused=poison_unused)
    if head_major:
        batch = head_major_batch(batch)
    return fp8_batch(batch, K_SCALE, V_SCALE)


def dequantised(batch: tuple, scales: torch.Tensor) -> tuple:
    """The batch with its FP8 caches de-quantised into q's dtype: what the kernels must attend over
    (NaN-poisoned slots zeroed: the reference multiplies masked scores by the values all the same)."""
    q, k_cache, v_cache, *rest = batch
    return (q, *(dequantize(c, s, q.dtype).nan_to_num(0.0) for c, s in ((k_cache, scales[0]), (v_cache, scales[1]))),
            *rest)


def test_the_reference_attends_over_the_dequantised_caches(device: torch.device) -> None:
    batch, scales = fp8(MIXED, 16, device, num_heads=8, head_dim=64)
    out = reference.paged_attention(*batch, 0.125, kv_scales=scales)
    assert rel_err(out, dense_float64(dequantised(batch, scales), 0.125)) < 1e-5
    with pytest.raises(ValueError, match="kv_scales"):
        reference.paged_attention(*batch, 0.125)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_every_block_size_matches_the_dequantised_reference(block_size: int, device: torch.device) -> None:
    """Decode and prefill kernels in one batch."""
    batch, scales = fp8(SMALL_MIXED, block_size, device)
    expected = reference.paged_attention(*batch, 0.125, kv_scales=scales)
    out = run_triton(batch, 0.125, hint=True, kv_scales=scales)
    assert rel_err(out, expected) < tolerance(torch.float32, device)
    if block_size == 16:
        for k_scale, v_scale in ((K_SCALE, K_SCALE), (V_SCALE, V_SCALE)):  # one of the two read wrongly
            wrong = torch.tensor([k_scale, v_scale], device=device)
            assert rel_err(run_triton(batch, 0.125, hint=True, kv_scales=wrong), expected) > 0.1


@pytest.mark.parametrize("num_splits,hint", [(3, True), (None, False)], ids=["split-kv", "multi"])
def test_split_kv_and_multi_token_decode(num_splits: int | None, hint: bool, device: torch.device) -> None:
    """Split-KV partial outputs carry v_scale into the reduce; the MULTI variant (no hint) too."""
    batch, scales = fp8(DECODE, 16, device, head_major=True)
    expected = reference.paged_attention(*batch, 0.125, kv_scales=scales)
    out = run_triton(batch, 0.125, hint=hint, num_splits=num_splits, kv_scales=scales)
    assert rel_err(out, expected) < tolerance(torch.float32, device)


@pytest.mark.parametrize("block_size", [16, 32])
def test_tma_decode_reads_fp8_blocks(block_size: int, device: torch.device) -> None:
    batch, scales = fp8([(37, 5), (20, 1), (70, 1)], block_size, device, head_major=True)
    stages = 1 if device.type == "cpu" else 3
    out = run_triton(batch, 0.125, hint=True, use_tma=True, tma=TmaDecodeConfig(chunk=4, num_stages=stages),
                     prefill=PrefillConfig(block_m=32, block_n=16, num_stages=stages), kv_scales=scales)
    assert rel_err(out, reference.paged_attention(*batch, 0.125, kv_scales=scales)) < tolerance(torch.float32, device)


def test_float16_queries_over_fp8_caches(device: torch.device) -> None:
    batch, scales = fp8(SMALL_MIXED, 16, device, q_dtype=torch.float16)
    out = run_triton(batch, 0.125, hint=True, kv_scales=scales)
    assert rel_err(out, reference.paged_attention(*batch, 0.125, kv_scales=scales)) < tolerance(torch.float16, device)


@pytest.mark.parametrize("case,message", [
    ("no scales", "an FP8 cache needs"), ("shape", r"\(2,\) float32"), ("dtype", r"\(2,\) float32"),
    ("mixed caches", "v_cache dtype"),
])
def test_fp8_caches_reject_bad_scales(case: str, message: str) -> None:
    (q, k_cache, v_cache, *rest), scales = fp8(DECODE, 8, torch.device("cpu"))
    if case == "no scales":
        scales = None  # type: ignore[assignment]
    elif case == "shape":
        scales = scales[:1]
    elif case == "dtype":
        scales = scales.double()
    else:
        v_cache = dequantize(v_cache, scales[1], torch.float32)
    with pytest.raises(ValueError, match=message):
        paged_attention(q, k_cache, v_cache, *rest, 0.1, kv_scales=scales)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_gpu_fp8_real_sizes_every_path(block_size: int) -> None:
    """bf16 queries over FP8 caches whose unused slots are NaN, Llama-3-8B's heads: decode (split
    or not, with and without the hint), prefill and chunked prefill, and TMA decode where it reads
    the caches, all against de-quantise-then-bf16 attention."""
    torch.manual_seed(block_size)
    lens = torch.randint(1, 3000, (24,)).tolist()
    decode = [(n, 1) for n in lens]
    mixed = decode[:12] + [(1024, 1024), (4096 + 512, 512), (700, 300)]
    scale = 1 / math.sqrt(128)
    for specs in (decode, mixed):
        batch, scales = fp8(specs, block_size, torch.device("cuda"), head_major=True, num_heads=32,
                            num_kv_heads=8, head_dim=128, q_dtype=torch.bfloat16, poison_unused=True)
        ref = reference.paged_attention(*dequantised(batch, scales), scale)
        for splits in (None, 1, 8):
            for hint in (False, True):
                out = run_triton(batch, scale, hint=hint, num_splits=splits, kv_scales=scales)
                assert rel_err(out, ref) < 1.5e-2
        if block_size in (16, 32):
            assert rel_err(run_triton(batch, scale, hint=True, use_tma=True, kv_scales=scales), ref) < 1.5e-2
