"""silu_and_mul is bit-identical to torch's two ops (`F.silu(gate) * up`, HF's LlamaMLP), for
rows narrower and wider than one program's block, on the GPU. Under Triton's interpreter (CPU)
two things differ: it rounds float32 to bfloat16 by truncation, where the GPU and torch round to
nearest, so bfloat16 is checked on the GPU only; and torch's CPU SiLU is vectorised with an exp
of its own, so there the output is compared to within two units in the last place (silu one
ulp off, then the product's rounding)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels.activation import silu_and_mul


def assert_same(out: torch.Tensor, expected: torch.Tensor) -> None:
    if out.is_cuda:
        assert torch.equal(out, expected)
    else:  # an ulp is at most 2^-10 of the value in float16, 2^-23 in float32
        ulp = 2.0 ** (-10 if out.dtype == torch.float16 else -23)
        torch.testing.assert_close(out, expected, rtol=2 * ulp, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens,width", [(1, 40), (7, 1500), (3, 2048)])
def test_bit_identical_to_torch(num_tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
    # a spread that reaches silu's saturated tails and its curved middle
    x = (torch.randn(num_tokens, 2 * width, device=device) * 6).to(dtype)
    expected = reference.silu_and_mul(x)
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, width) and out.dtype == dtype and out.is_contiguous()
    assert_same(out, expected)


def test_rows_of_a_strided_view(device: torch.device) -> None:
    """The rows may lie further apart than 2I (a view of a wider buffer); the padding is not read."""
    wide = torch.randn(5, 3 * 64, device=device, dtype=torch.float16)
    wide[:, 128:] = float("nan")
    x = wide[:, :128]
    assert_same(silu_and_mul(x), reference.silu_and_mul(x.contiguous()))


def test_no_rows() -> None:
    assert silu_and_mul(torch.empty(0, 8)).shape == (0, 4)


@pytest.mark.parametrize("x,message", [
    (torch.randn(4, 7), "gate and up halves"), (torch.randn(4, 8, 2), "x must have 2 dims"),
    (torch.randn(8, 4).t(), "contiguous in its last dim"), (torch.zeros(4, 8, dtype=torch.int32), "x dtype"),
])
def test_rejects_bad_arguments(x: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        silu_and_mul(x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_gpu_llama_8b_width(num_tokens: int, dtype: torch.dtype) -> None:
    x = (torch.randn(num_tokens, 2 * 14336, device="cuda") * 4).to(dtype)
    assert torch.equal(silu_and_mul(x), reference.silu_and_mul(x))
