"""FP8 cache writes: the reference stores x / scale rounded to e4m3 and saturated at 448, with the
layer's k and v scales; the Triton write and the fused rotary write store exactly those bytes,
in their slots only, skipping padding.

Triton's interpreter rounds float32 -> float8 wrongly (half up, without carrying a rounded
mantissa into the exponent, so 127.9 becomes 64), so the interpreter tests write values that need
no rounding (multiples of the scale on e4m3's grid, and values past the range); rounding itself
is checked on the GPU at real sizes against torch's cast.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels.kv_quant import FP8, FP8_MAX, dequantize, quantize
from kvpilot.kernels.reference import kv_cache_empty
from kvpilot.runtime.tunables import BLOCK_SIZES

SCALES = (2.0 ** -4, 2.0 ** -7)  # powers of two: x / scale is exact


def grid_values(shape: tuple[int, ...], scale: float, device: torch.device | str) -> torch.Tensor:
    """float32 values that are e4m3 numbers times `scale`, a few past the range (they saturate)."""
    x = torch.randn(shape) * 40
    x = x.to(FP8).float() * scale
    x.view(-1)[::17] = 1000 * scale  # past 448: saturates
    x.view(-1)[5::17] = -1000 * scale
    return x.to(device)


def fp8_caches(num_blocks: int, block_size: int, heads: int, head_dim: int, head_major: bool,
               device: torch.device | str) -> list[torch.Tensor]:
    caches = [kv_cache_empty(num_blocks, block_size, heads, head_dim, head_major=head_major, dtype=FP8,
                             device=device) for _ in range(2)]
    for c in caches:
        c.copy_(torch.randn(c.shape).to(FP8))  # whatever was there before
    return caches


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_quantise_rounds_to_nearest_and_saturates() -> None:
    scale = torch.tensor(0.5)
    x = torch.tensor([0.0, 1.0, 1.0625, 1.0626, 224.0, 240.0, -10_000.0, 2 ** -10])
    # e4m3 spaces 1..2 by 1/8: 2.125 / 2 = 1.0625 is halfway between 1.0 and 1.125 and goes to even
    assert quantize(x, scale).float().tolist() == [0.0, 2.0, 2.0, 2.25, 448.0, 448.0, -448.0, 2 ** -9]
    assert dequantize(quantize(x, scale), scale, torch.float32)[1].item() == 1.0
    assert FP8_MAX == 448.0


@pytest.mark.parametrize("head_major", [False, True])
def test_reference_write_quantises_with_each_scale(head_major: bool) -> None:
    k, v = torch.randn(10, 2, 32), torch.randn(10, 2, 32)
    k_cache, v_cache = fp8_caches(4, 8, 2, 32, head_major, "cpu")
    slots = torch.randperm(32)[:10]
    slots[4] = -1
    before = [as_bytes(c).clone() for c in (k_cache, v_cache)]
    scales = torch.tensor(SCALES)
    reference.write_kv_cache(k, v, k_cache, v_cache, slots, kv_scales=scales)
    written = slots[slots >= 0]
    blocks, offsets = written // 8, written % 8
    assert torch.equal(as_bytes(k_cache[blocks, offsets]), as_bytes(quantize(k[slots >= 0], scales[0])))
    assert torch.equal(as_bytes(v_cache[blocks, offsets]), as_bytes(quantize(v[slots >= 0], scales[1])))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[written] = False
    for cache, old in zip((k_cache, v_cache), before, strict=True):
        assert torch.equal(as_bytes(cache).flatten(0, 1)[untouched], old.flatten(0, 1)[untouched])
    with pytest.raises(ValueError, match="an FP8 cache needs"):
        reference.write_kv_cache(k, v, k_cache, v_cache, slots)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_major", [False, True])
def test_triton_write_stores_the_references_bytes(block_size: int, head_major: bool, device: torch.device) -> None:
    from kvpilot.kernels.cache import write_kv_cache

    num_tokens, heads, head_dim = 24, 3, 64
    k = grid_values((num_tokens, heads, head_dim), SCALES[0], device)
    v = grid_values((num_tokens, heads, head_dim), SCALES[1], device)
    num_blocks = 2 * -(-num_tokens // block_size) + 1
    caches = fp8_caches(num_blocks, block_size, heads, head_dim, head_major, device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[[2, 11]] = -1
    scales = torch.tensor(SCALES, device=device)
    expected = [c.clone() for c in caches]
    reference.write_kv_cache(k, v, *expected, slots, kv_scales=scales)
    write_kv_cache(k, v, *caches, slots, scales)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(as_bytes(got), as_bytes(want))


def test_fused_rotary_write_quantises_the_rotated_keys(device: torch.device) -> None:
    """At position 0 the rotation is the identity, so the keys need no rounding under the
    interpreter; on a GPU (the next test) positions are random."""
    from kvpilot.kernels.cache import write_kv_cache
    from kvpilot.kernels.rotary import rotary_and_write_kv, rotary_embedding

    t, heads, kv_heads, head_dim, block_size = 9, 4, 2, 64, 16
    cos_sin = torch.cat([torch.ones(8, head_dim // 2), torch.zeros(8, head_dim // 2)], -1).to(device)
    positions = torch.zeros(t, dtype=torch.long, device=device)
    q = torch.randn(t, heads, head_dim, device=device)
    k, v = grid_values((t, kv_heads, head_dim), SCALES[0], device), grid_values((t, kv_heads, head_dim), SCALES[1], device)
    caches = fp8_caches(3, block_size, kv_heads, head_dim, True, device)
    slots = torch.randperm(3 * block_size, device=device)[:t]
    slots[3] = -1
    scales = torch.tensor(SCALES, device=device)
    ref_q, ref_k, ref_caches = q.clone(), k.clone(), [c.clone() for c in caches]
    rotary_embedding(positions, ref_q, ref_k, cos_sin)
    write_kv_cache(ref_k, v, *ref_caches, slots, scales)
    rotary_and_write_kv(positions, q, k, cos_sin, v, *caches, slots, scales)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    for got, want in zip(caches, ref_caches, strict=True):
        assert torch.equal(as_bytes(got), as_bytes(want))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_gpu_fp8_writes_round_as_torch(block_size: int) -> None:
    """bf16 keys and values at real sizes (Llama-3-8B's KV heads), random positions: the write
    kernel and the fused rotary write store the bytes of torch's own cast of x / scale."""
    from kvpilot.kernels.rotary import rotary_and_write_kv

    num_tokens, kv_heads, head_dim = 4096, 8, 128
    k = torch.randn(num_tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) * 4
    v = torch.randn(num_tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    num_blocks = 2 * num_tokens // block_size + 1
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::97] = -1
    scales = torch.tensor([0.013, 0.0041], device="cuda")
    from kvpilot.kernels.cache import write_kv_cache

    caches = fp8_caches(num_blocks, block_size, kv_heads, head_dim, True, "cuda")
    expected = [c.clone() for c in caches]
    reference.write_kv_cache(k, v, *expected, slots, kv_scales=scales)
    write_kv_cache(k, v, *caches, slots, scales)
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(caches, expected, strict=True))

    inv_freq = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(8192, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).cuda()
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    q = torch.randn(num_tokens, 32, head_dim, device="cuda", dtype=torch.bfloat16)
    ref_q, ref_k = q.clone(), k.clone()
    reference.rotary_embedding(positions, ref_q, ref_k, cos_sin)
    expected = [c.clone() for c in caches]
    reference.write_kv_cache(ref_k, v, *expected, slots, kv_scales=scales)
    rotary_and_write_kv(positions, q, k, cos_sin, v, *caches, slots, scales)
    # the rotation itself may differ from the reference's by bf16 rounding (test_rotary.py), which
    # may move a key to the neighbouring e4m3 value: compare de-quantised, within one e4m3 step
    for got, want, s in zip(caches, expected, scales, strict=True):
        a, b = dequantize(got, s, torch.float32), dequantize(want, s, torch.float32)
        assert ((a - b).abs() <= b.abs() / 8 + s * 2 ** -9).all()  # one step; subnormals step by 2^-9
        assert (as_bytes(got) != as_bytes(want)).float().mean() < 1e-2
