"""paged_attention's launcher: over ragged decode/prefill/chunked-prefill batches with shuffled
block tables, whatever kernels it picks equal the reference; it rejects bad arguments, each with
a message naming the argument."""

from __future__ import annotations

import math

import pytest
import torch
from paged_batches import (
    DECODE,
    MIXED,
    dense_float64,
    head_major_batch,
    head_major_copy,
    make_batch,
    rel_err,
    run_triton,
    tolerance,
)

from kvpilot.kernels import reference
from kvpilot.kernels.paged_attention import paged_attention, tma_decode
from kvpilot.runtime.tunables import BLOCK_SIZES


@pytest.mark.parametrize("hint", [False, True], ids=["no-hint", "max_query_len"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_every_block_size_matches_reference(
    block_size: int, specs: list[tuple[int, int]], hint: bool, device: torch.device
) -> None:
    batch = make_batch(specs, 8, 2, 64, block_size, torch.float32, device)
    out = run_triton(batch, 0.125, hint=hint)
    assert rel_err(out, reference.paged_attention(*batch, 0.125)) < tolerance(torch.float32, device)


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_head_major_cache_layout_matches_reference(
    block_size: int, num_splits: int | None, specs: list[tuple[int, int]], device: torch.device
) -> None:
    """The GPU engine stores each (block, KV head) contiguously; the kernels follow the strides."""
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(specs, 8, 2, 64, block_size, torch.float32, device)
    strided = (q, head_major_copy(k_cache), head_major_copy(v_cache), tables, seq_lens, qsl)
    out = run_triton(strided, 0.125, num_splits=num_splits)
    expected = reference.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125)
    assert rel_err(out, expected) < tolerance(torch.float32, device)
    assert rel_err(reference.paged_attention(*strided, 0.125), expected) < 1e-6


@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_strided_q_view_matches_reference(specs: list[tuple[int, int]], device: torch.device) -> None:
    """q as the model passes it: a view into the fused qkv rows (row stride > heads x head_dim)."""
    q, *rest = make_batch(specs, 8, 2, 64, 16, torch.float32, device)
    qkv = torch.randn(q.shape[0], (8 + 4) * 64, device=device)
    qkv[:, :8 * 64] = q.reshape(q.shape[0], -1)
    strided_q = qkv[:, :8 * 64].view(q.shape)
    assert not strided_q.is_contiguous()
    expected = reference.paged_attention(q, *rest, 0.125)  # type: ignore[arg-type]
    assert rel_err(run_triton((strided_q, *rest), 0.125), expected) < tolerance(torch.float32, device)  # type: ignore[arg-type]
    assert rel_err(reference.paged_attention(strided_q, *rest, 0.125), expected) < 1e-6  # type: ignore[arg-type]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (12, 3), (16, 1)])
@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_gqa_ratios_match_reference(
    num_heads: int, num_kv_heads: int, specs: list[tuple[int, int]], device: torch.device
) -> None:
    batch = make_batch(specs, num_heads, num_kv_heads, 64, 16, torch.float32, device)
    out = run_triton(batch, 0.125, hint=True)
    assert rel_err(out, reference.paged_attention(*batch, 0.125)) < tolerance(torch.float32, device)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_head_dims_match_reference(head_dim: int, device: torch.device) -> None:
    batch = make_batch(MIXED, 4, 2, head_dim, 16, torch.float32, device)
    scale = head_dim ** -0.5
    out = run_triton(batch, scale)
    assert rel_err(out, reference.paged_attention(*batch, scale)) < tolerance(torch.float32, device)


@pytest.mark.parametrize("hint", [False, True], ids=["no-hint", "max_query_len"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_all_decode_shape_with_empty_sequence_handles_multi_token_rows(
    num_splits: int, hint: bool, device: torch.device
) -> None:
    # as many tokens as sequences, yet one sequence has none and another has two: without the
    # hint the decode kernel loops over the two tokens; with max_query_len=2 the prefill kernel runs
    specs = [(10, 2), (7, 0), (9, 1)]
    batch = make_batch(specs, 4, 2, 64, 8, torch.float32, device)
    out = run_triton(batch, 0.125, hint=hint, num_splits=num_splits)
    assert rel_err(out, reference.paged_attention(*batch, 0.125)) < tolerance(torch.float32, device)


@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_slots_outside_contexts_are_never_read(specs: list[tuple[int, int]], device: torch.device) -> None:
    batch = make_batch(specs, 8, 2, 64, 16, torch.float32, device, poison_unused=True)
    out = run_triton(batch, 0.125, num_splits=2)
    assert rel_err(out, dense_float64(batch, 0.125)) < tolerance(torch.float32, device)


def test_float16_matches_reference(device: torch.device) -> None:
    batch = make_batch(MIXED, 8, 2, 64, 16, torch.float16, device)
    out = paged_attention(*batch, 0.125)
    assert out.dtype == torch.float16
    assert rel_err(out, reference.paged_attention(*batch, 0.125)) < tolerance(torch.float16, device)


@pytest.mark.parametrize("block_size", [8, 16])
def test_prefer_tma_takes_the_tma_kernel_where_it_can_read_the_caches(
    block_size: int, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the checked entry the Triton ops call: prefer_tma takes the TMA kernel on
    head-major 16-token caches and stays on the pointer kernel for 8-token ones (which it cannot
    read) instead of raising; without it the pointer kernel runs. Every output is checked. The
    TMA launcher is wrapped, not replaced, to see which kernel ran."""
    launches: list[int] = []
    real = tma_decode.launch
    monkeypatch.setattr(tma_decode, "launch", lambda *args: launches.append(1) or real(*args))
    batch = head_major_batch(make_batch([(1, 1), (15, 1), (16, 1), (17, 1), (64, 1), (65, 1)], 8, 2, 64,
                                        block_size, torch.float32, device))
    expected = reference.paged_attention(*batch, 0.125)
    for prefer_tma in (False, True):
        before = len(launches)
        out = paged_attention(*batch, 0.125, max_query_len=1, prefer_tma=prefer_tma)
        assert rel_err(out, expected) < tolerance(torch.float32, device)
        assert len(launches) - before == (prefer_tma and block_size == 16), prefer_tma


@pytest.mark.parametrize("bad", [-1, 100])
def test_launcher_rejects_impossible_max_query_len(bad: int) -> None:
    batch = make_batch(DECODE, 4, 2, 64, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention(*batch, 0.1, max_query_len=bad)


def test_empty_batch_returns_empty() -> None:
    q, k_cache, v_cache, _, _, _ = make_batch([(4, 1)], 4, 2, 64, 8, torch.float32, "cpu")
    out = paged_attention(q[:0], k_cache, v_cache, torch.zeros((0, 1), dtype=torch.int32),
                          torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 0.1)
    assert out.shape == (0, 4, 64)


BAD_ARGS = {
    "q_2d": (lambda b: (b[0][:, 0], *b[1:]), "q must have 3 dims"),
    "q_dtype": (lambda b: (b[0].double(), *b[1:]), "q dtype"),
    "cache_dtype": (lambda b: (b[0], b[1].half(), *b[2:]), "k_cache dtype"),
    "v_shape": (lambda b: (b[0], b[1], b[2][:, :4], *b[3:]), "v_cache must have shape"),
    "head_dim": (lambda b: (b[0][..., :32].contiguous(), *b[1:]), "head_dim"),
    "group": (lambda b: (b[0][:, :3].contiguous(), *b[1:]), "multiple of num_kv_heads"),
    "q_strides": (lambda b: (b[0].transpose(1, 2).contiguous().transpose(1, 2), *b[1:]), "contiguous in its last dim"),
    "table_dtype": (lambda b: (*b[:3], b[3].long(), *b[4:]), "block_tables dtype"),
    "seq_lens_shape": (lambda b: (*b[:4], b[4][:-1], b[5]), "seq_lens must have shape"),
    "qsl_shape": (lambda b: (*b[:5], b[5][:-1]), "query_start_loc must have shape"),
    "block_size": (lambda b: (b[0], b[1][:, :6], b[2][:, :6], *b[3:]), "power of 2"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_launcher_rejects_bad_arguments(case: str) -> None:
    make_bad, message = BAD_ARGS[case]
    batch = make_batch(DECODE, 4, 2, 64, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=message):
        paged_attention(*make_bad(batch), 0.1)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_gpu_decode_and_prefill_bf16_real_sizes(block_size: int) -> None:
    torch.manual_seed(block_size)
    lens = torch.randint(1, 3000, (24,)).tolist()
    decode = [(n, 1) for n in lens]
    mixed = decode[:12] + [(1024, 1024), (4096 + 512, 512), (700, 300)]
    for specs in (decode, mixed):
        batch = make_batch(specs, 32, 8, 128, block_size, torch.bfloat16, "cuda")
        scale = 1 / math.sqrt(128)
        ref = reference.paged_attention(*batch, scale)
        for splits in (None, 1, 8):
            for hint in (False, True):
                assert rel_err(run_triton(batch, scale, hint=hint, num_splits=splits), ref) < 1.5e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (80, 32, 32), (96, 16, 1), (128, 32, 4)])
def test_gpu_head_dims_and_groups_bf16(head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    specs = [(n, 1) for n in (1, 17, 555, 2048)] + [(300, 300), (1000, 77)]
    batch = make_batch(specs, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, "cuda",
                       poison_unused=True)
    scale = head_dim ** -0.5
    assert rel_err(run_triton(batch, scale), dense_float64(batch, scale)) < 1.5e-2
    assert rel_err(run_triton(batch, scale, hint=True, num_splits=4), dense_float64(batch, scale)) < 1.5e-2
