"""The pointer decode kernel: split-KV slices merged by the reduce kernel, padding sequences left
alone, and how the number of slices is chosen."""

from __future__ import annotations

import pytest
import torch
from paged_batches import DECODE, MIXED, dense_float64, make_batch, rel_err, run_triton, tolerance

from kvpilot.kernels import reference
from kvpilot.kernels.paged_attention import paged_attention_with
from kvpilot.kernels.paged_attention.pointer_decode import DecodeConfig, choose_num_splits


def test_the_context_is_split_only_when_programs_cannot_fill_the_chip() -> None:
    """Off CUDA the launcher assumes 4 SMs: at least 8 (sequence, KV head) programs fill them;
    fewer split long contexts up to one wave of two programs per SM, short ones less."""
    cpu = torch.device("cpu")
    assert choose_num_splits(4, 2, 100_000, cpu) == 1
    assert choose_num_splits(1, 2, 100_000, cpu) == 4  # 2 programs x 4 slices = 8, one wave
    assert choose_num_splits(1, 3, 100_000, cpu) == 2  # 9 programs would overflow the wave
    assert choose_num_splits(1, 2, 100, cpu) == 2  # slices of at least 64 tokens (the default)
    assert choose_num_splits(1, 2, 100, cpu, min_split=128) == 1
    assert choose_num_splits(1, 1, 60, cpu) == 1


@pytest.mark.parametrize("hint", [False, True], ids=["no-hint", "max_query_len"])
@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_split_kv_matches_reference(
    num_splits: int, specs: list[tuple[int, int]], hint: bool, device: torch.device
) -> None:
    batch = make_batch(specs, 6, 2, 80, 8, torch.float32, device)
    out = run_triton(batch, 0.1, hint=hint, num_splits=num_splits)
    assert rel_err(out, reference.paged_attention(*batch, 0.1)) < tolerance(torch.float32, device)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_over_tables_far_wider_than_the_contexts(num_splits: int, device: torch.device) -> None:
    """A CUDA graph's block tables are as wide as max_model_len, far past most contexts: each
    sequence's slices come from its own context, so short and long contexts, exact multiples of
    the slice and of a tile, and one token all come out right, with NaN in every slot past a
    context (a slice reaching past it would read them)."""
    specs = [(1, 1), (15, 1), (16, 1), (17, 1), (63, 1), (64, 1), (65, 1), (200, 1)]
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(specs, 4, 2, 32, 8, torch.float32, device,
                                                            poison_unused=True)
    wide = torch.full((len(specs), 64), k_cache.shape[0] - 1, dtype=torch.int32, device=device)
    wide[:, :tables.shape[1]] = tables  # 512 tokens of table, the last block a poisoned spare
    batch = (q, k_cache, v_cache, wide, seq_lens, qsl)
    out = run_triton(batch, 0.125, hint=True, num_splits=num_splits)
    assert rel_err(out, dense_float64(batch, 0.125)) < tolerance(torch.float32, device)


@pytest.mark.parametrize("min_split", [16, 40, 48])
def test_slices_of_at_least_min_split_tokens(min_split: int, device: torch.device) -> None:
    """Slices longer than an even cut (min_split over the context / num_splits, rounded up to
    whole 16-token tiles) leave the last programs with nothing to read; the reduce merges only the
    slices that hold keys."""
    specs = [(100, 1), (40, 1), (161, 1)]
    batch = make_batch(specs, 4, 2, 32, 8, torch.float32, device, poison_unused=True)
    out = run_triton(batch, 0.125, hint=True, num_splits=8,
                     decode=DecodeConfig(block_n=16, num_stages=1, min_split=min_split))
    assert rel_err(out, dense_float64(batch, 0.125)) < tolerance(torch.float32, device)


def test_decode_only_kernel_with_padding_sequences(device: torch.device) -> None:
    """max_query_len=1 with empty sequences in the batch (padding): their programs do nothing and
    every real row is right; only the padding token's row is left unwritten."""
    specs = [(10, 1), (7, 0), (9, 1), (5, 0)]
    q, *rest = make_batch(specs, 4, 2, 64, 8, torch.float32, device)
    padded_q = torch.cat([q, torch.randn(2, *q.shape[1:], device=device)])  # 4 tokens for 4 sequences
    out = torch.full_like(padded_q, float("nan"))
    paged_attention_with(padded_q, *rest, 0.125, max_query_len=1, out=out)  # type: ignore[arg-type]
    expected = reference.paged_attention(q, *rest, 0.125)  # type: ignore[arg-type]
    assert rel_err(out[:2], expected) < tolerance(torch.float32, device)
    assert out[2:].isnan().all()  # no program owns the padding rows


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_long_context_split_kv_bf16() -> None:
    batch = make_batch([(32768, 1)] * 2 + [(20000, 1)], 32, 8, 128, 16, torch.bfloat16, "cuda")
    scale = 128 ** -0.5
    assert rel_err(run_triton(batch, scale, hint=True), reference.paged_attention(*batch, scale)) < 1.5e-2
