"""rotary_embedding rotates q and k in place exactly as the reference (NeoX halves);
rotary_and_write_kv does that and the cache write in one launch."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels.cache import write_kv_cache
from kvpilot.kernels.rotary import rotary_and_write_kv, rotary_embedding


def cos_sin(max_positions: int, head_dim: int, device: torch.device | str) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def check(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
          device: torch.device | str, positions_dtype: torch.dtype = torch.int64) -> None:
    cache = cos_sin(4096, head_dim, device)
    positions = torch.randint(0, 4096, (num_tokens,), device=device, dtype=positions_dtype)
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    ref_q, ref_k = q.clone(), k.clone()
    reference.rotary_embedding(positions, ref_q, ref_k, cache)
    rotary_embedding(positions, q, k, cache)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 80), (8, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                           device: torch.device) -> None:
    check(11, num_heads, num_kv_heads, head_dim, dtype, device)


def test_strided_views_of_one_qkv_buffer(device: torch.device) -> None:
    """The model rotates q and k as views into its fused qkv output, leaving v untouched."""
    t, heads, kv_heads, d = 7, 6, 2, 64
    cache = cos_sin(256, d, device)
    positions = torch.randint(0, 256, (t,), device=device)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device=device)
    ref_q = qkv[:, :heads * d].reshape(t, heads, d).clone()
    ref_k = qkv[:, heads * d:(heads + kv_heads) * d].reshape(t, kv_heads, d).clone()
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    reference.rotary_embedding(positions, ref_q, ref_k, cache)
    q = qkv[:, :heads * d].view(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    assert not q.is_contiguous()
    rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)


def test_int32_positions(device: torch.device) -> None:
    check(5, 4, 2, 64, torch.float32, device, positions_dtype=torch.int32)


@pytest.mark.parametrize("case,message", [
    ("k_dtype", "k dtype"), ("k_shape", "k must have shape"), ("positions", "positions must have shape"),
    ("cache_dtype", "cos_sin_cache dtype"), ("cache_width", "cos_sin_cache must be"),
])
def test_rejects_bad_arguments(case: str, message: str) -> None:
    q, k = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    positions, cache = torch.arange(4), cos_sin(16, 64, "cpu")
    if case == "k_dtype":
        k = k.half()
    elif case == "k_shape":
        k = k[..., :32]
    elif case == "positions":
        positions = positions[:3]
    elif case == "cache_dtype":
        cache = cache.half()
    else:
        cache = cos_sin(16, 32, "cpu")
    with pytest.raises(ValueError, match=message):
        rotary_embedding(positions, q, k, cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_real_sizes() -> None:
    check(4096, 32, 8, 128, torch.bfloat16, "cuda")


@pytest.mark.parametrize("head_dim,block_size", [(64, 8), (80, 16), (128, 32)])
@pytest.mark.parametrize("head_major", [False, True])
def test_fused_cache_write_is_rotary_then_write(head_dim: int, block_size: int, head_major: bool,
                                                device: torch.device) -> None:
    """rotary_and_write_kv leaves q, k and both caches exactly as rotary_embedding followed by
    write_kv_cache do: the rotated keys in their slots, the values as given, padding tokens
    (slot -1) rotated but not written, every other slot untouched; q, k, v as views of one buffer."""
    t, heads, kv_heads = 9, 6, 2
    table = cos_sin(512, head_dim, device)
    positions = torch.randint(0, 512, (t,), device=device)
    num_blocks = 2 * -(-t // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, device=device)[:t]
    slots[[1, 5]] = -1
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=device, dtype=torch.float16)
    caches = [reference.kv_cache_empty(num_blocks, block_size, kv_heads, head_dim, head_major=head_major,
                                       dtype=torch.float16, device=device) for _ in range(2)]
    for c in caches:
        c.copy_(torch.randn(c.shape))

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = buf[:, :heads * head_dim].view(t, heads, head_dim)
        k = buf[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
        return q, k, buf[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)

    ref_buf, ref_caches = qkv.clone(), [c.clone() for c in caches]
    q, k, v = views(ref_buf)
    rotary_embedding(positions, q, k, table)
    write_kv_cache(k, v, *ref_caches, slots)
    q, k, v = views(qkv)
    rotary_and_write_kv(positions, q, k, table, v, *caches, slots)
    assert torch.equal(qkv, ref_buf)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


def test_fused_cache_write_checks_the_cache_arguments() -> None:
    q, k, v = torch.randn(4, 4, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    caches = [torch.zeros(3, 8, 2, 64) for _ in range(2)]
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        rotary_and_write_kv(torch.arange(4), q, k, cos_sin(16, 64, "cpu"), v, *caches, torch.arange(3))
