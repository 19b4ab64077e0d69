"""The FP8 activation kernels (per-token quantization, fused into RMSNorm and into SiLU x up)
equal the reference's quantization of the unfused op's output: the same scales and the same
FP8 values, for dynamic and static scales, rows wider than one program's block included.

Triton 3.6's interpreter (the CPU runs) casts float32 to e4m3 wrongly in two cases: a rounding
that carries into the exponent loses the carry (1.97 -> 1.0 where the GPU and torch give 2.0),
and values at or below the smallest normal (2^-6) round down to a subnormal. On the CPU those
elements may differ in exactly those ways; and as the interpreter's SiLU may be an ulp off
torch's (test_activation.py), a value on a rounding boundary may land one e4m3 step away. Every
other element, and every scale, must be identical. The GPU test is bit-exact where the unfused
kernels are (quantization, SiLU x up)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels.fp8_quant import quantize_fp8, silu_and_mul_fp8
from kvpilot.kernels.norm import fused_add_rms_norm_fp8, rms_norm_fp8


def assert_same_quantization(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor],
                             values: torch.Tensor, exact: bool = True) -> None:
    """`exact`: bit-identical on the GPU. Not exact: the kernel's values may differ from the
    reference's in the last place (a norm summed in another order), so may the scales and,
    on a rounding boundary, an element by one e4m3 step."""
    (q, scales), (ref_q, ref_scales) = got, expected
    assert q.dtype == torch.float8_e4m3fn and q.shape == ref_q.shape and scales.shape == (q.shape[0], 1)
    got_v, ref_v = q.float(), ref_q.float()
    # the reference is a quantization of the values: within e4m3's rounding of each row's scale, or
    # saturated (a static scale too small for them)
    error = (ref_v * ref_scales - values.float()).abs()
    in_range = values.float().abs() <= 448 * ref_scales
    assert (error <= values.float().abs() / 16 + ref_scales * 2.0 ** -10)[in_range].all()
    assert (ref_v.abs() == 448)[~in_range].all()
    if q.is_cuda and exact:
        assert torch.equal(scales, ref_scales)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
        return
    last_place = 2 ** -7 if values.dtype == torch.bfloat16 else 2 ** -10 if values.dtype == torch.float16 else 2 ** -22
    torch.testing.assert_close(scales, ref_scales, rtol=last_place, atol=0)
    differ = got_v != ref_v
    if not q.is_cuda:
        lost_carry = (ref_v.abs().log2() == ref_v.abs().log2().round()) & (got_v == ref_v / 2)
        subnormal = (ref_v.abs() <= 2.0 ** -6) & ((got_v - ref_v).abs() <= 2.0 ** -9)
        differ &= ~lost_carry & ~subnormal
    one_step = (got_v - ref_v).abs() <= torch.maximum(got_v.abs(), ref_v.abs()) / 8
    assert not (differ & ~one_step).any(), (got_v[differ], ref_v[differ])
    assert differ.float().mean() < 0.01


def static_scale(device: torch.device) -> torch.Tensor:
    return torch.tensor([0.01], dtype=torch.float32, device=device)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("width", [40, 1500])
def test_quantize_matches_reference(width: int, static: bool, device: torch.device) -> None:
    x = torch.randn(6, width, device=device) * torch.logspace(-2, 2, 6, device=device)[:, None]
    x[2] = 0.0  # a row of zeros gets the floor scale, not a division by zero
    scale = static_scale(device) if static else None
    assert_same_quantization(quantize_fp8(x, scale), reference.quantize_fp8(x, scale), x)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_silu_and_mul_fp8_matches_reference(dtype: torch.dtype, static: bool, device: torch.device) -> None:
    x = (torch.randn(5, 2 * 1100, device=device) * 4).to(dtype)
    scale = static_scale(device) if static else None
    values = reference.silu_and_mul(x)
    assert_same_quantization(silu_and_mul_fp8(x, scale), reference.quantize_fp8(values, scale), values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_norms_fp8_match_reference(dtype: torch.dtype, device: torch.device) -> None:
    x = torch.randn(7, 576, device=device, dtype=dtype)
    residual = torch.randn(7, 576, device=device, dtype=dtype)
    weight = torch.randn(576, device=device, dtype=dtype)
    normed = reference.rms_norm(residual, weight, 1e-5)
    assert_same_quantization(rms_norm_fp8(residual, weight, 1e-5, None), reference.quantize_fp8(normed), normed)
    ref_residual = residual + x
    before = x.clone()
    normed = reference.rms_norm(ref_residual, weight, 1e-5)
    got = fused_add_rms_norm_fp8(x, residual, weight, 1e-5, static_scale(device))
    torch.testing.assert_close(residual, ref_residual, rtol=0, atol=0)
    assert torch.equal(x, before)  # x is the layer's output; only the residual takes the sum
    assert_same_quantization(got, reference.quantize_fp8(normed, static_scale(device)), normed)


def test_rejects_a_bad_static_scale(device: torch.device) -> None:
    with pytest.raises(ValueError, match="scale must be a \\(1,\\) float32"):
        quantize_fp8(torch.randn(2, 16, device=device), torch.ones(2, device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 256, 4096])
def test_gpu_bf16_real_sizes_bit_identical(rows: int) -> None:
    x = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    gate_up = torch.randn(rows, 2 * 14336, dtype=torch.bfloat16, device="cuda") * 3
    assert_same_quantization(quantize_fp8(x, None), reference.quantize_fp8(x), x)
    values = reference.silu_and_mul(gate_up)
    assert_same_quantization(silu_and_mul_fp8(gate_up, None), reference.quantize_fp8(values), values)
    normed = reference.rms_norm(residual + x, weight, 1e-5)
    got = fused_add_rms_norm_fp8(x, residual, weight, 1e-5, None)
    assert_same_quantization(got, reference.quantize_fp8(normed), normed, exact=False)
