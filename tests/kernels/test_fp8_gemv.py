"""The few-row FP8 product equals the de-quantized product (float32 products of exact fp16 widenings,
summed in float32: only the summation order differs), with or without bias, for row counts up to
its limit and shapes that do not fill its tiles; on the GPU also against torch._scaled_mm at the
Llama-3-8B shapes."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels.fp8_gemv import MAX_ROWS, fp8_gemv


def operands(m: int, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    x, xs = reference.quantize_fp8(torch.randn(m, k, device=device) * 3)
    w, ws = reference.quantize_fp8(torch.randn(n, k, device=device) * 0.02)
    return x, xs, w, ws


def dequantized(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    y = (x.float() @ w.float().t()) * xs * ws.t()
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("m", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(40, 96), (64, 1100)])
def test_equals_the_dequantized_product(m: int, n: int, k: int, device: torch.device) -> None:
    x, xs, w, ws = operands(m, n, k, device)
    bias = torch.randn(n, device=device)
    for b in (None, bias):
        out = fp8_gemv(x, xs, w, ws, b, torch.float32)
        assert out.shape == (m, n) and out.dtype == torch.float32
        torch.testing.assert_close(out, dequantized(x, xs, w, ws, b), rtol=1e-5, atol=1e-5)


def test_rejects_too_many_rows_and_bad_scales(device: torch.device) -> None:
    x, xs, w, ws = operands(MAX_ROWS + 1, 32, 64, device)
    with pytest.raises(ValueError, match="at most 16"):
        fp8_gemv(x, xs, w, ws, None, torch.float16)
    with pytest.raises(ValueError, match="w_scales must have shape"):
        fp8_gemv(x[:2], xs[:2], w, ws[:8], None, torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_real_sizes_match_scaled_mm(m: int, n: int, k: int) -> None:
    x, xs, w, ws = operands(m, n, k, torch.device("cuda"))
    out = fp8_gemv(x, xs, w, ws, None, torch.bfloat16)
    cublas = torch._scaled_mm(x, w.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
    exact = dequantized(x, xs, w, ws, None)
    # both round a float32 sum to bfloat16; they may differ by that rounding
    torch.testing.assert_close(out.float(), exact, rtol=2 ** -7, atol=1e-3 * exact.abs().max().item())
    torch.testing.assert_close(out, cublas, rtol=2 ** -6, atol=1e-3 * exact.abs().max().item())
