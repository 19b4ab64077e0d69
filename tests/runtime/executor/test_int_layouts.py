"""AWQ's and GPTQ's on-disk layouts read into kvpilot's packed layout: hand-made words decode to the
integers the formats define, RTN-written tensors de-quantise back to their source weights within
rounding, and AWQ agrees with compressed-tensors' own AutoAWQ reader and de-quantiser."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels.int_gemm import dequantize, unpack_rows
from kvpilot.runtime.executor.quant.int_layouts import (
    awq_tensors,
    awq_to_int_weight,
    gptq_tensors,
    gptq_to_int_weight,
    pack_awq,
    unpack_awq,
)
from kvpilot.runtime.executor.quant.rtn import RtnWeight, rtn_quantize

WORD = 0x76543210  # nibble i holds the value i


def within_rounding(w: torch.Tensor, source: torch.Tensor, step: torch.Tensor) -> None:
    """RTN's error: within one step of the element's group (the grid's ends clip by up to one),
    half a step on average (a quarter for uniform rounding); a misread layout is off by whole
    weights."""
    error = (w - source).abs()
    assert bool((error <= step * 1.001).all())
    assert float(error.mean()) <= 0.3 * float(step.mean())


def steps(rtn: RtnWeight, k: int) -> torch.Tensor:
    """(N, K): each input's group scale."""
    return rtn.scales.t().repeat_interleave(k // rtn.scales.shape[0], dim=1)


def test_awq_word_holds_outputs_in_its_interleaved_order() -> None:
    # AutoAWQ packs outputs 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7
    assert unpack_awq(torch.tensor([[WORD]], dtype=torch.int32)).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]


def test_awq_packing_round_trips() -> None:
    q = torch.randint(0, 16, (6, 32), dtype=torch.int32)
    assert torch.equal(unpack_awq(pack_awq(q)), q)


def test_awq_checkpoint_dequantises_to_its_source_within_rounding() -> None:
    source = torch.randn(48, 256) * 0.05
    rtn = rtn_quantize(source, 4, 64, symmetric=False)
    tensors = awq_tensors(rtn)
    assert tensors["qweight"].shape == (256, 6) and tensors["qzeros"].shape == (4, 6)
    assert tensors["scales"].shape == (4, 48) and tensors["scales"].dtype == torch.float16
    w = awq_to_int_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], 64, torch.float32)
    within_rounding(dequantize(w), source, steps(rtn, source.shape[1]))


def test_awq_matches_compressed_tensors_reader() -> None:
    converters = pytest.importorskip("compressed_tensors.entrypoints.convert.converters.autoawq")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    rtn = rtn_quantize(torch.randn(64, 256), 4, 128, symmetric=False)
    tensors = awq_tensors(rtn)
    weight, scale, zero = converters.AutoAWQConverter(group_size=128)._convert_gemm_module(
        tensors["qweight"], tensors["scales"], tensors["qzeros"])
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, group_size=128, strategy="group")
    theirs = ct_dequantize(weight.float(), scale.float(), zero.float(), args=args, dtype=torch.float32)
    ours = dequantize(awq_to_int_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], 128, torch.float32))
    assert torch.equal(ours, theirs)


def test_gptq_word_holds_consecutive_inputs_and_zeros_minus_one() -> None:
    qweight = torch.zeros(2, 8, dtype=torch.int32)  # (K / 8, N): words of inputs 0..7 and 8..15
    qweight[0, 0] = WORD  # inputs 0..7 of output 0 hold 0..7
    qzeros = torch.tensor([[0x77777777]], dtype=torch.int32)  # stored 7 -> zero point 8 (gptq format)
    w = gptq_to_int_weight(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16), None, 4, 16, 1, torch.float32)
    assert unpack_rows(w.qweight, 4)[0].tolist() == list(range(8)) + [0] * 8
    assert dequantize(w)[0].tolist() == [float(v - 8) for v in range(8)] + [-8.0] * 8


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("offset", [1, 0])  # the gptq and gptq_v2 checkpoint formats
def test_gptq_checkpoint_dequantises_to_its_source_within_rounding(bits: int, symmetric: bool, offset: int) -> None:
    source = torch.randn(32, 128) * 0.05
    rtn = rtn_quantize(source, bits, 32, symmetric)
    tensors = gptq_tensors(rtn, bits, offset)
    pack = 32 // bits
    assert tensors["qweight"].shape == (128 // pack, 32) and tensors["qzeros"].shape == (4, 32 // pack)
    if symmetric and offset:
        assert bool((unpack_rows(tensors["qzeros"], bits) == 2 ** (bits - 1) - 1).all())
    w = gptq_to_int_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], bits, 32,
                           offset, torch.float32)
    assert w.perm is None  # g_idx in order: no permutation
    within_rounding(dequantize(w), source, steps(rtn, source.shape[1]))


def test_gptq_act_order_reads_the_groups_of_its_permuted_inputs() -> None:
    source = torch.randn(16, 128)
    perm = torch.randperm(128)
    rtn = rtn_quantize(source[:, perm], 4, 32, symmetric=True)  # groups of the permuted order
    q = torch.empty_like(rtn.q)
    q[:, perm] = rtn.q
    tensors = gptq_tensors(RtnWeight(q, rtn.scales, rtn.zeros), 4, 1, perm)
    assert torch.equal(tensors["g_idx"][perm], torch.arange(128, dtype=torch.int32) // 32)
    w = gptq_to_int_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], 4, 32, 1,
                           torch.float32)
    assert w.perm is not None  # packed columns: group by group, each group's inputs in any order
    assert torch.equal(tensors["g_idx"][w.perm.long()], torch.arange(128, dtype=torch.int32) // 32)
    within_rounding(dequantize(w), source, steps(rtn, 128)[:, torch.argsort(perm)])  # each input's own group


def test_gptq_refuses_groups_of_uneven_size() -> None:
    g_idx = torch.tensor([0] * 17 + [1] * 15, dtype=torch.int32)
    with pytest.raises(ValueError, match="g_idx does not give each group 16 inputs"):
        gptq_to_int_weight(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32),
                           torch.ones(2, 8, dtype=torch.float16), g_idx, 4, 16, 1, torch.float32)


def test_gptq_format_cannot_store_a_zero_point_of_zero() -> None:
    rtn = RtnWeight(torch.zeros(8, 32, dtype=torch.int32), torch.ones(1, 8), torch.zeros(1, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="cannot store a zero point of 0"):
        gptq_tensors(rtn, 4, 1)
    assert gptq_tensors(rtn, 4, 0)["qzeros"].abs().sum() == 0
