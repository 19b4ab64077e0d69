"""rms_norm and fused_add_rms_norm equal the reference, rounding included."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels.norm import fused_add_rms_norm, rms_norm


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rms_norm_matches_reference(hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    x = torch.randn(7, hidden, dtype=dtype, device=device) * 3
    weight = torch.randn(hidden, dtype=dtype, device=device)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6), **tol(dtype))


@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_add_rms_norm_updates_both_in_place(hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    x = torch.randn(9, hidden, dtype=dtype, device=device)
    residual = torch.randn(9, hidden, dtype=dtype, device=device)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    ref_x, ref_residual = x.clone(), residual.clone()
    reference.fused_add_rms_norm(ref_x, ref_residual, weight, 1e-5)
    fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, ref_residual, atol=0, rtol=0)
    torch.testing.assert_close(x, ref_x, **tol(dtype))


def test_rms_norm_accepts_row_strided_input(device: torch.device) -> None:
    base = torch.randn(5, 256, device=device)
    x = base[:, :128]
    weight = torch.randn(128, device=device)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("case,message", [
    ("x_3d", "x must have 2 dims"), ("weight_shape", "weight must have shape"),
    ("residual_shape", "residual must have shape"), ("x_strides", "contiguous in its last dim"),
    ("x_dtype", "x dtype"),
])
def test_rejects_bad_arguments(case: str, message: str) -> None:
    x, residual, weight = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    if case == "x_3d":
        x = x[None]
    elif case == "weight_shape":
        weight = weight[:32]
    elif case == "residual_shape":
        residual = residual[:2]
    elif case == "x_strides":
        x = torch.randn(64, 4).t()
    else:
        x = x.long()
    with pytest.raises(ValueError, match=message):
        fused_add_rms_norm(x, residual, weight, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hidden", [576, 4096, 8192])
def test_gpu_bf16_real_sizes(hidden: int) -> None:
    x = torch.randn(2048, hidden, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **tol(x.dtype))
    ref_x, ref_residual = x.clone(), residual.clone()
    reference.fused_add_rms_norm(ref_x, ref_residual, weight, 1e-6)
    fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, ref_residual, atol=0, rtol=0)
    torch.testing.assert_close(x, ref_x, **tol(x.dtype))
