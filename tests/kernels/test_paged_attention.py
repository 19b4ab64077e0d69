"""paged_attention: the Triton kernels equal the reference, and the reference equals float64
dense attention, over ragged decode/prefill/chunked-prefill batches with shuffled block tables."""

from __future__ import annotations

import math

import pytest
import torch
from paged_batches import DECODE, MIXED, Batch, dense_float64, make_batch

from kvpilot.kernels import paged_attention as pa
from kvpilot.kernels import reference
from kvpilot.kernels.paged_attention import (
    DecodeConfig,
    PrefillConfig,
    TmaDecodeConfig,
    paged_attention,
    paged_attention_with,
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output holds NaN (an element was not written or read garbage)"
    return ((out.double() - ref.double().to(out.device)).norm() / ref.double().norm()).item()


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32:
        return 1e-5 if device.type == "cpu" else 2e-3  # tf32 dots on the GPU
    return 3e-3 if dtype == torch.float16 else 1.5e-2


def max_query_len(batch: Batch) -> int:
    return int(batch[5].diff().max())


def run_triton(batch: Batch, scale: float, hint: bool = False, **kwargs: object) -> torch.Tensor:
    """The kernels into a NaN-poisoned output; hint passes max_query_len as the engine does
    (without it an all-decode batch runs the decode kernel that loops over any q_len)."""
    poisoned = torch.full_like(batch[0], float("nan"))
    if hint:
        kwargs["max_query_len"] = max_query_len(batch)
    return paged_attention_with(*batch, scale, out=poisoned, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_reference_equals_float64_dense(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch(specs, num_heads, num_kv_heads, 64, 16, torch.float32, "cpu")
    out = reference.paged_attention(*batch, 0.125)
    assert rel_err(out, dense_float64(batch, 0.125)) < 1e-5


@pytest.mark.parametrize("hint", [False, True], ids=["no-hint", "max_query_len"])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_every_block_size_matches_reference(
    block_size: int, specs: list[tuple[int, int]], hint: bool, device: torch.device
) -> None:
    batch = make_batch(specs, 8, 2, 64, block_size, torch.float32, device)
    out = run_triton(batch, 0.125, hint=hint)
    assert rel_err(out, reference.paged_attention(*batch, 0.125)) < tolerance(torch.float32, device)


def head_major_copy(cache: torch.Tensor) -> torch.Tensor:
    hm = reference.kv_cache_empty(*cache.shape, head_major=True, dtype=cache.dtype, device=cache.device)
    hm.copy_(cache)
    assert hm.stride(1) == cache.shape[3] and not hm.is_contiguous()
    return hm


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


@pytest.mark.parametrize("prefetch", [False, True], ids=["ids-in-loop", "ids-ahead"])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("specs", [DECODE, MIXED, [(150, 150), (140, 60), (97, 1)]], ids=["decode", "mixed", "long"])
def test_block_id_prefetch_either_way_matches_reference(
    specs: list[tuple[int, int]], block_size: int, num_splits: int | None, prefetch: bool, device: torch.device
) -> None:
    """Both ways to load block ids (in the tile's own iteration, or one ahead), in decode and
    prefill: decode defaults to the first and prefill to the second, so each default leaves the
    other way untested elsewhere."""
    batch = make_batch(specs, 8, 2, 64, block_size, torch.float32, device, poison_unused=True)
    stages = 1 if device.type == "cpu" else 3
    out = run_triton(batch, 0.125, hint=True, num_splits=num_splits,
                     decode=DecodeConfig(block_n=16, num_stages=stages, prefetch=prefetch),
                     prefill=PrefillConfig(block_m=32, block_n=16, num_stages=stages, prefetch=prefetch))
    assert rel_err(out, dense_float64(batch, 0.125)) < tolerance(torch.float32, device)


@pytest.mark.parametrize("hint", [False, True], ids=["no-hint", "max_query_len"])
@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_split_kv_matches_reference(
    num_splits: int, specs: list[tuple[int, int]], hint: bool, device: torch.device
) -> None:
    batch = make_batch(specs, 6, 2, 80, 8, torch.float32, device)
    out = run_triton(batch, 0.1, hint=hint, num_splits=num_splits)
    assert rel_err(out, reference.paged_attention(*batch, 0.1)) < tolerance(torch.float32, device)


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


@pytest.mark.parametrize("bad", [-1, 100])
def test_launcher_rejects_impossible_max_query_len(bad: int) -> None:
    batch = make_batch(DECODE, 4, 2, 64, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention(*batch, 0.1, max_query_len=bad)


def head_major_batch(batch: Batch) -> Batch:
    q, k_cache, v_cache, *rest = batch
    return (q, head_major_copy(k_cache), head_major_copy(v_cache), *rest)  # type: ignore[return-value]


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


@pytest.mark.parametrize("block_size", [8, 16])
def test_graph_launches_and_the_switch_pick_the_tma_kernel_where_it_can_read(
    block_size: int, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the checked entry the engine calls: launches recorded into a CUDA graph
    (in_graph) take the TMA kernel on head-major 16-token caches, eager ones do not, and
    KVPILOT_DECODE_TMA=1 / 0 turns it on everywhere / off everywhere. 8-token caches (which it
    cannot read) stay on the pointer kernel instead of raising. Every output is checked. The TMA
    launcher is wrapped, not replaced, to see which kernel ran."""
    launches: list[int] = []
    real = pa._decode_tma
    monkeypatch.setattr(pa, "_decode_tma", lambda *args: launches.append(1) or real(*args))
    batch = head_major_batch(make_batch(TMA_DECODE[:6], 8, 2, 64, block_size, torch.float32, device))
    expected = reference.paged_attention(*batch, 0.125)
    for switch, in_graph, takes_tma in [(None, False, False), (None, True, True), ("graphs", True, True),
                                        ("1", False, True), ("0", True, False), ("0", False, False)]:
        if switch is None:
            monkeypatch.delenv("KVPILOT_DECODE_TMA", raising=False)
        else:
            monkeypatch.setenv("KVPILOT_DECODE_TMA", switch)
        before = len(launches)
        out = paged_attention(*batch, 0.125, max_query_len=1, in_graph=in_graph)
        assert rel_err(out, expected) < tolerance(torch.float32, device)
        assert len(launches) - before == (takes_tma and block_size == 16), (switch, in_graph)


def test_unknown_tma_switch_value_is_rejected(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_DECODE_TMA", "yes")
    batch = head_major_batch(make_batch(TMA_DECODE[:2], 8, 2, 64, 16, torch.float32, device))
    with pytest.raises(ValueError, match="KVPILOT_DECODE_TMA must be one of graphs, 1, 0, not 'yes'"):
        paged_attention(*batch, 0.125, max_query_len=1)


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


def test_long_prefill_spans_many_tiles(device: torch.device) -> None:
    batch = make_batch([(150, 150), (140, 60)], 4, 2, 64, 16, torch.float32, device)
    out = run_triton(batch, 0.125)
    assert rel_err(out, reference.paged_attention(*batch, 0.125)) < tolerance(torch.float32, device)


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
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
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


@pytest.mark.gpu
@gpu
def test_gpu_long_context_split_kv_bf16() -> None:
    batch = make_batch([(32768, 1)] * 2 + [(20000, 1)], 32, 8, 128, 16, torch.bfloat16, "cuda")
    scale = 128 ** -0.5
    assert rel_err(run_triton(batch, scale, hint=True), reference.paged_attention(*batch, scale)) < 1.5e-2


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
