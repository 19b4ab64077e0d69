"""write_kv_cache scatters each token into its slot, skips slot -1 and touches nothing else."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels.cache import write_kv_cache
from kvpilot.runtime.tunables import BLOCK_SIZES


def make_case(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    num_blocks = 2 * (-(-num_tokens // block_size)) + 1
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[torch.rand(num_tokens, device=device) < 0.25] = -1  # padding tokens
    return k, v, k_cache, v_cache, slots


def check_against_reference(case: tuple[torch.Tensor, ...]) -> None:
    k, v, k_cache, v_cache, slots = case
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(k, v, ref_k, ref_v, slots)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matches_reference_and_skips_padding(block_size: int, dtype: torch.dtype, device: torch.device) -> None:
    check_against_reference(make_case(40, 3, 80, block_size, dtype, device))


@pytest.mark.parametrize("block_size", [8, 64])
def test_head_major_cache_layout_matches_contiguous(block_size: int, device: torch.device) -> None:
    """Both implementations write a head-major (strided) cache exactly where the contiguous one goes."""
    k, v, k_cache, v_cache, slots = make_case(40, 3, 64, block_size, torch.float32, device)
    hm = [reference.kv_cache_empty(*c.shape, head_major=True, dtype=c.dtype, device=device) for c in (k_cache, v_cache)]
    for dst, src in zip(hm, (k_cache, v_cache), strict=True):
        dst.copy_(src)
    check_against_reference((k, v, *hm, slots))
    reference.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(hm[0], k_cache) and torch.equal(hm[1], v_cache)


def test_int32_slot_mapping(device: torch.device) -> None:
    k, v, k_cache, v_cache, slots = make_case(20, 2, 64, 16, torch.float32, device)
    check_against_reference((k, v, k_cache, v_cache, slots.int()))


@pytest.mark.parametrize("case,message", [
    ("dtype", "k dtype"), ("shape", "k must have shape"), ("slots", "slot_mapping must have shape"),
    ("slot_dtype", "slot_mapping dtype"), ("strides", "contiguous in its last dim"),
])
def test_rejects_bad_arguments(case: str, message: str) -> None:
    k, v, k_cache, v_cache, slots = make_case(8, 2, 64, 16, torch.float32, "cpu")
    if case == "dtype":
        k = k.half()
    elif case == "shape":
        k = k[:, :1]
    elif case == "slots":
        slots = slots[:-1]
    elif case == "slot_dtype":
        slots = slots.float()
    else:
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match=message):
        write_kv_cache(k, v, k_cache, v_cache, slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_gpu_bf16_real_sizes(block_size: int) -> None:
    check_against_reference(make_case(4096, 8, 128, block_size, torch.bfloat16, "cuda"))
