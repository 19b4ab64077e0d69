"""The TMA decode kernel: equal to float64 dense attention over head-major caches whose unused
slots are NaN, around every edge of its loops; it refuses caches it cannot read."""

from __future__ import annotations

import pytest
import torch
from paged_batches import (
    DECODE,
    dense_float64,
    head_major_batch,
    make_batch,
    rel_err,
    run_triton,
    tolerance,
)

from kvpilot.kernels import reference
from kvpilot.kernels.paged_attention import PrefillConfig, TmaDecodeConfig, paged_attention_with

# contexts around every edge of the TMA kernel's loops at chunk 4: whole chunks (4 blocks), a partial
# chunk past them, a partly filled last block, and sequences shorter than one block
TMA_DECODE = [(1, 1), (15, 1), (16, 1), (17, 1), (64, 1), (65, 1), (96, 1), (200, 1), (300, 1)]
TMA_MIXED = [(37, 5), (20, 1), (130, 1), (19, 19), (70, 1), (33, 16), (300, 1)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("specs", [TMA_DECODE, TMA_MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 4, 32), (32, 2, 64), (6, 2, 16)])
def test_tma_decode_matches_reference(
    block_size: int, specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
    device: torch.device,
) -> None:
    """The TMA decode kernel (opt-in; on a GPU it needs Hopper or later) over head-major
    caches whose unused slots are NaN, with the chunk of block ids small enough that every loop
    of the kernel runs; in a mixed batch it takes the single-token sequences and the prefill
    kernel the rest."""
    batch = head_major_batch(make_batch(specs, num_heads, num_kv_heads, head_dim, block_size, torch.float32,
                                        device, poison_unused=True))
    stages = 1 if device.type == "cpu" else 3
    out = run_triton(batch, 0.125, hint=True, use_tma=True, tma=TmaDecodeConfig(chunk=4, num_stages=stages),
                     prefill=PrefillConfig(block_m=32, block_n=16, num_stages=stages))
    assert rel_err(out, dense_float64(batch, 0.125)) < tolerance(torch.float32, device)


def test_tma_decode_default_chunk_and_float16(device: torch.device) -> None:
    """The default config (64 block ids a chunk) on contexts of two full chunks and a partial
    one, one full and a partial, and a partial only, in float16."""
    batch = head_major_batch(make_batch([(2100, 1), (1100, 1), (40, 1)], 8, 2, 64, 16, torch.float16, device))
    out = run_triton(batch, 0.125, hint=True, use_tma=True)
    assert rel_err(out, reference.paged_attention(*batch, 0.125)) < tolerance(torch.float16, device)


def test_tma_decode_leaves_padding_rows_alone(device: torch.device) -> None:
    """As the pointer kernel: empty sequences (padding) own no rows, so the padding rows stay unwritten."""
    specs = [(10, 1), (7, 0), (40, 1), (5, 0)]
    q, *rest = head_major_batch(make_batch(specs, 4, 2, 64, 16, torch.float32, device))
    padded_q = torch.cat([q, torch.randn(2, *q.shape[1:], device=device)])
    out = torch.full_like(padded_q, float("nan"))
    paged_attention_with(padded_q, *rest, 0.125, max_query_len=1, out=out, use_tma=True,  # type: ignore[arg-type]
                         tma=TmaDecodeConfig(chunk=2, num_stages=1))
    assert rel_err(out[:2], reference.paged_attention(q, *rest, 0.125)) < tolerance(torch.float32, device)  # type: ignore[arg-type]
    assert out[2:].isnan().all()


@pytest.mark.parametrize("block_size,head_dim,head_major,message", [
    (8, 64, True, "block_size 8"), (64, 64, True, "block_size 64"), (16, 80, True, "head_dim 80"),
    (16, 64, False, "k_cache is not head-major"),
])
def test_tma_decode_refuses_caches_it_cannot_read(block_size: int, head_dim: int, head_major: bool,
                                                  message: str) -> None:
    batch = make_batch(DECODE, 4, 2, head_dim, block_size, torch.float32, "cpu")
    if head_major:
        batch = head_major_batch(batch)
    with pytest.raises(ValueError, match=f"TMA decode kernel cannot serve these caches: {message}"):
        paged_attention_with(*batch, 0.1, max_query_len=1, use_tma=True)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_tma_decode_bf16_real_sizes(block_size: int) -> None:
    """The TMA decode kernel at real sizes on the layout the engine allocates (head-major)."""
    torch.manual_seed(block_size)
    specs = [(n, 1) for n in torch.randint(1, 3000, (24,)).tolist()] + [(2048, 1), (512, 1)]
    batch = head_major_batch(make_batch(specs, 32, 8, 128, block_size, torch.bfloat16, "cuda",
                                        poison_unused=True))
    scale = 128 ** -0.5
    ref = dense_float64(batch, scale)
    assert rel_err(run_triton(batch, scale, hint=True, use_tma=True), ref) < 1.5e-2
