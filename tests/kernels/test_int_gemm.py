"""The integer-weight kernels equal de-quantise-then-matmul (`int_linear_reference`): 4- and 8-bit,
group-wise and per-channel, with act-order's permuted inputs, split-K, rows and columns past a
tile's edge. CPU runs them under Triton's interpreter at small sizes (float32 and float16; the
4-bit decode kernel also in bfloat16, whose dots it then runs in float32 there); the GPU at real
sizes in bfloat16."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels.int_gemm import (
    IntWeight,
    dequantize,
    int_gemm,
    int_gemm_decode,
    int_gemm_prefill,
    int_linear_reference,
    pack_rows,
    unpack_rows,
)
from kvpilot.kernels.int_gemm.decode import DecodeConfig
from kvpilot.kernels.int_gemm.decode_int4 import Int4DecodeConfig
from kvpilot.kernels.int_gemm.launcher import (
    block_k_for,
    choose_decode,
    choose_int4_decode,
    int4_decode_serves,
)
from kvpilot.kernels.int_gemm.prefill import PrefillConfig

SMALL_PREFILL = PrefillConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)


def random_weight(n: int, k: int, bits: int, group_size: int, dtype: torch.dtype, device: torch.device,
                  act_order: bool = False) -> IntWeight:
    groups = k // group_size
    q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.int32)
    scales = (torch.rand(groups, n) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 2 ** bits, (groups, n)).to(dtype)
    perm = torch.randperm(k).to(torch.int32).to(device) if act_order else None
    return IntWeight(pack_rows(q, bits).to(device), scales.to(device), zeros.to(device), bits, group_size, perm)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 1e-2}


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_rows_round_trips_every_bit(bits: int) -> None:
    q = torch.randint(0, 2 ** bits, (5, 64), dtype=torch.int32)
    q[0] = 2 ** bits - 1  # every bit set, the word's sign bit included
    packed = pack_rows(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (5, 64 * bits // 32)
    assert torch.equal(unpack_rows(packed, bits), q)


def test_pack_rows_puts_the_first_input_in_the_lowest_bits() -> None:
    q = torch.arange(8, dtype=torch.int32)[None, :]  # inputs 0..7 hold the values 0..7
    assert pack_rows(q, 4).item() == 0x76543210


def test_dequantize_applies_zeros_scales_and_the_permutation() -> None:
    q = torch.zeros(1, 32, dtype=torch.int32)
    q[0, :4] = torch.tensor([3, 0, 15, 7])
    w = IntWeight(pack_rows(q, 4), torch.tensor([[0.5], [2.0]]), torch.tensor([[1.0], [0.0]]), 4, 16,
                  torch.arange(31, -1, -1, dtype=torch.int32))
    # packed column j is input 31 - j: (q - 1) * 0.5 in the first group, q * 2 in the second
    expected = [0.0] * 16 + [-0.5] * 12 + [3.0, 7.0, -0.5, 1.0]
    assert dequantize(w, torch.float32)[0].tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits,group_size,act_order", [(4, 64, False), (4, 256, True), (8, 32, False)])
@pytest.mark.parametrize("m", [1, 5, 17])
def test_decode_kernel_matches_reference(m: int, bits: int, group_size: int, act_order: bool, dtype: torch.dtype,
                                         device: torch.device) -> None:
    w = random_weight(48, 256, bits, group_size, dtype, device, act_order)  # 48: a partial column tile
    x = torch.randn(m, 256, dtype=dtype, device=device)
    out = int_gemm_decode(x, w, DecodeConfig(block_n=32, block_k=64))
    assert out.shape == (m, 48) and out.dtype == dtype
    torch.testing.assert_close(out, int_linear_reference(x, w), **tolerance(dtype))


@pytest.mark.parametrize("split_k", [2, 4])
def test_decode_split_k_sums_its_slices(split_k: int, device: torch.device) -> None:
    w = random_weight(64, 512, 4, 128, torch.float32, device)
    x = torch.randn(3, 512, device=device)
    out = int_gemm_decode(x, w, DecodeConfig(block_n=32, block_k=64, split_k=split_k))
    torch.testing.assert_close(out, int_linear_reference(x, w), **tolerance(torch.float32))


def test_decode_reads_row_strided_activations(device: torch.device) -> None:
    w = random_weight(32, 128, 4, 128, torch.float32, device)
    wide = torch.randn(4, 256, device=device)
    wide[:, 128:] = float("nan")  # never read
    out = int_gemm_decode(wide[:, :128], w, DecodeConfig(block_n=32, block_k=64))
    torch.testing.assert_close(out, int_linear_reference(wide[:, :128].contiguous(), w), **tolerance(torch.float32))


def exact_reference(x: torch.Tensor, w: IntWeight) -> torch.Tensor:
    """float32 de-quantise-then-matmul on float32 scales and zeros: the 4-bit decode kernel's
    result before its output's rounding."""
    wide = IntWeight(w.qweight, w.scales.float(), w.zeros.float(), w.bits, w.group_size, w.perm)
    return int_linear_reference(x.float(), wide)


def int4_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """float32 sums (in another order) and one rounding to the output's dtype."""
    return {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 1e-3, "rtol": 2e-3},
            torch.bfloat16: {"atol": 1e-3, "rtol": 8e-3}}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 7, 16])
def test_int4_decode_serves_small_batches_and_matches_reference(m: int, group_size: int, dtype: torch.dtype,
                                                                device: torch.device) -> None:
    w = random_weight(80, 256, 4, group_size, dtype, device)  # 80: a partial column tile
    x = torch.randn(m, 256, dtype=dtype, device=device)
    assert int4_decode_serves(m, w)
    out = int_gemm(x, w)
    assert out.shape == (m, 80) and out.dtype == dtype
    torch.testing.assert_close(out.float(), exact_reference(x, w), **int4_tolerance(dtype))


VARIANTS = [Int4DecodeConfig(block_n=bn, block_k=bk, order=order, swap=swap, sum_dot=sum_dot, asm=True)
            for order, bk in ((0, 64), (1, 64), (2, 128)) for swap in (False, True) for sum_dot in (True, False)
            for bn in (16, 32) if (bn == 16) == swap]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", VARIANTS, ids=str)
def test_int4_decode_variants_match_reference(config: Int4DecodeConfig, dtype: torch.dtype, act_order: bool,
                                              device: torch.device) -> None:
    """Every K order, orientation and way of summing x (asm=True runs the pure-Triton twin under
    the interpreter)."""
    w = random_weight(48, 256, 4, 128, dtype, device, act_order)
    x = torch.randn(5, 256, dtype=dtype, device=device)
    out = int_gemm_decode(x, w, config)
    torch.testing.assert_close(out.float(), exact_reference(x, w), **int4_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("order", [0, 1, 2])
def test_int4_decode_reads_every_nibble_in_place(order: int, dtype: torch.dtype, device: torch.device) -> None:
    """One-hot rows of x pick single weights: row r of the output is column k_r of W, exactly, so
    a nibble read from the wrong position or shifted by a bit shows as a whole step of q."""
    n, k = 32, 256
    q = (torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :] * 5) % 16  # every value at every position
    scales = torch.full((k // 128, n), 0.25).to(dtype)
    zeros = torch.full((k // 128, n), 3.0).to(dtype)
    w = IntWeight(pack_rows(q.to(torch.int32), 4).to(device), scales.to(device), zeros.to(device), 4, 128)
    cols = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 15, 100, 127, 128, 131, 204, 255])
    x = torch.zeros(16, k, dtype=dtype)
    x[torch.arange(16), cols] = 1.0
    out = int_gemm_decode(x.to(device), w, Int4DecodeConfig(block_k=128, order=order))
    torch.testing.assert_close(out.float().cpu(), ((q[:, cols] - 3.0) * 0.25).t(), atol=0, rtol=0)


@pytest.mark.parametrize("split_k", [2, 4])
def test_int4_decode_split_k_sums_its_slices(split_k: int, device: torch.device) -> None:
    w = random_weight(64, 512, 4, 64, torch.float32, device, act_order=True)
    x = torch.randn(3, 512, device=device)
    out = int_gemm_decode(x, w, Int4DecodeConfig(block_k=64, split_k=split_k, swap=True, block_n=16))
    torch.testing.assert_close(out, exact_reference(x, w), **int4_tolerance(torch.float32))


def test_int4_decode_leaves_other_weights_and_batches_to_the_old_kernels() -> None:
    cpu = torch.device("cpu")
    assert not int4_decode_serves(1, random_weight(32, 128, 8, 64, torch.float32, cpu))
    assert not int4_decode_serves(17, random_weight(32, 128, 4, 64, torch.float32, cpu))
    config = choose_int4_decode(1, random_weight(4096, 256, 4, 32, torch.float32, cpu), num_sms=132)
    assert config.block_k == 32 and 4096 // config.block_n * config.split_k >= 132
    # plenty of column tiles: K is still split, so that no program walks more than INT4_STEPS steps
    for (n, k), split in {(6144, 4096): 4, (4096, 14336): 8, (28672, 512): 1}.items():
        assert choose_int4_decode(1, random_weight(n, k, 4, 128, torch.float32, cpu), num_sms=132).split_k == split
    with pytest.raises(ValueError, match="4-bit weights"):
        int_gemm_decode(torch.randn(1, 128), random_weight(32, 128, 8, 64, torch.float32, cpu), Int4DecodeConfig())
    with pytest.raises(ValueError, match="order 2 needs block_k >= 128"):
        int_gemm_decode(torch.randn(1, 128), random_weight(32, 128, 4, 64, torch.float32, cpu),
                        Int4DecodeConfig(order=2))
    with pytest.raises(ValueError, match="order must be one of"):
        Int4DecodeConfig(order=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits,act_order", [(4, False), (4, True), (8, False)])
def test_prefill_kernel_matches_reference(bits: int, act_order: bool, dtype: torch.dtype, device: torch.device) -> None:
    w = random_weight(80, 128, bits, 64, dtype, device, act_order)
    x = torch.randn(70, 128, dtype=dtype, device=device)  # 70 rows, 80 columns: partial tiles both ways
    out = int_gemm_prefill(x, w, SMALL_PREFILL)
    torch.testing.assert_close(out, int_linear_reference(x, w), **tolerance(dtype))


def test_per_channel_weights_take_a_tile_that_divides_the_inputs(device: torch.device) -> None:
    w = random_weight(32, 192, 4, 192, torch.float32, device)  # one group of 192 inputs: 64-wide tiles
    x = torch.randn(2, 192, device=device)
    assert block_k_for(192, 128) == 64
    torch.testing.assert_close(int_gemm(x, w), int_linear_reference(x, w), **tolerance(torch.float32))


def test_decode_tiles_narrow_before_splitting_k() -> None:
    cpu = torch.device("cpu")
    wide = choose_decode(1, random_weight(28672, 256, 4, 128, torch.float32, cpu), num_sms=132)
    assert (wide.block_n, wide.split_k) == (64, 1)
    square = choose_decode(1, random_weight(4096, 256, 4, 128, torch.float32, cpu), num_sms=132)
    assert (square.block_n, square.split_k) == (16, 1)  # 256 programs: every SM busy without a split
    narrow = choose_decode(1, random_weight(512, 4096, 4, 128, torch.float32, cpu), num_sms=132)
    assert (narrow.block_n, narrow.split_k) == (16, 8)


@pytest.mark.parametrize("case,message", [("features", "x has 100 features"), ("dtype", "x dtype")])
def test_rejects_activations_that_do_not_fit(case: str, message: str) -> None:
    w = random_weight(32, 128, 4, 64, torch.float32, torch.device("cpu"))
    x = torch.randn(2, 100) if case == "features" else torch.randn(2, 128).to(torch.int32)
    with pytest.raises(ValueError, match=message):
        int_gemm(x, w)


@pytest.mark.parametrize("case,message", [
    ("group", "group_size 8 must be a multiple of 16"), ("scales", "scales must have shape"),
    ("bits", "bits must be one of"), ("perm", "perm must be"),
])
def test_a_weight_that_breaks_the_layout_is_refused_when_made(case: str, message: str) -> None:
    w = random_weight(32, 128, 4, 64, torch.float32, torch.device("cpu"))
    args = {"group": (w.qweight, torch.ones(16, 32), torch.zeros(16, 32), 4, 8),
            "scales": (w.qweight, w.scales[:1], w.zeros[:1], 4, 64),
            "bits": (w.qweight, w.scales, w.zeros, 3, 64),
            "perm": (w.qweight, w.scales, w.zeros, 4, 64, torch.arange(128))}[case]  # int64, not int32
    with pytest.raises(ValueError, match=message):
        IntWeight(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096)])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 2048])
def test_gpu_bf16_real_sizes(m: int, n: int, k: int) -> None:
    w = random_weight(n, k, 4, 128, torch.bfloat16, torch.device("cuda"), act_order=m == 16)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    expected = int_linear_reference(x.float(), IntWeight(w.qweight, w.scales.float(), w.zeros.float(), 4, 128, w.perm))
    out = int_gemm(x, w).float()
    # both sides hold the same bf16 weights; what differs is accumulation order and the output's rounding
    assert (out - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", [Int4DecodeConfig(block_n=bn, order=order, swap=swap, asm=asm, sum_dot=sum_dot,
                                                     split_k=2)
                                    for order in (0, 1, 2) for swap, bn in ((False, 32), (True, 64))
                                    for asm in (False, True) for sum_dot in (True, False)], ids=str)
def test_gpu_int4_decode_variants(config: Int4DecodeConfig) -> None:
    """Each variant compiled for real (the inline PTX runs only here), bf16 at a Llama shape."""
    w = random_weight(6144, 4096, 4, 128, torch.bfloat16, torch.device("cuda"))
    x = torch.randn(5, 4096, dtype=torch.bfloat16, device="cuda")
    expected = exact_reference(x, w)
    out = int_gemm_decode(x, w, config).float()
    assert (out - expected).abs().max() <= 0.01 * expected.abs().max()
