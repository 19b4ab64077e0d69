"""The quantized-linear framework and its FP8 method: each rank reads its part of fused and
row-parallel checkpoint tensors, FP8 weights (quantized at load or read from compressed-tensors
checkpoints) de-quantize to the source within FP8 rounding, and the CPU product is exactly the
de-quantized activations times the de-quantized weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.kernels.kv_quant import FP8
from kvpilot.kernels.reference import quantize_fp8
from kvpilot.runtime.executor.parallel import TPInfo
from kvpilot.runtime.executor.quant.base import Linear, QuantizedInput
from kvpilot.runtime.executor.quant.fp8 import Fp8Method, Fp8Scheme
from kvpilot.runtime.executor.quant.unquantized import UnquantizedMethod


class Source:
    """A checkpoint tensor in memory, read in part as safetensors slices are."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape = t, tuple(t.shape)

    def read(self, dim: int | None = None, start: int = 0, length: int = 0) -> torch.Tensor:
        return self.t if dim is None else self.t.narrow(dim, start, length)


def fp8_rounding_bound(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Largest error of e4m3 round-to-nearest: half a step of 3 mantissa bits (|w| / 16), or half
    the smallest subnormal step (2^-10 of the scale) near zero."""
    return w.abs() / 16 + scales * 2.0 ** -10


def test_each_rank_reads_its_part_of_fused_and_row_parallel_tensors() -> None:
    q, k, v = torch.randn(8, 6), torch.randn(4, 6), torch.randn(4, 6)
    o = torch.randn(6, 8)
    for rank in range(2):
        tp = TPInfo(rank, 2)
        qkv = Linear(6, [4, 2, 2], bias=False, parallel="column", tp=tp, method=UnquantizedMethod())
        row = Linear(4, [6], bias=False, parallel="row", tp=tp, method=UnquantizedMethod())
        filled = {}
        for shard, t in enumerate((q, k, v)):
            filled.update({f"{shard}": qkv.method.load(qkv, "weight", Source(t), "q/k/v", shard)["weight"]})
        row.method.load(row, "weight", Source(o), "o", 0)
        expected = torch.cat([q[rank * 4:(rank + 1) * 4], k[rank * 2:(rank + 1) * 2], v[rank * 2:(rank + 1) * 2]])
        assert torch.equal(qkv.weight, expected)
        assert list(filled.values()) == [24, 12, 12]
        assert torch.equal(row.weight, o[:, rank * 4:(rank + 1) * 4])


def test_fp8_quantizes_plain_weights_per_output_channel_within_rounding() -> None:
    torch.manual_seed(0)
    gate, up = torch.randn(16, 32) * 0.05, torch.randn(16, 32) * 3  # rows of very different ranges
    layer = Linear(32, [16, 16], bias=False, parallel="column", tp=TPInfo(), method=Fp8Method(Fp8Scheme()))
    filled = [layer.method.load(layer, "weight", Source(t), name, shard)
              for shard, (name, t) in enumerate((("gate", gate), ("up", up)))]
    assert filled == [{"weight": 512, "weight_scale": 16}] * 2
    source = torch.cat([gate, up])
    assert layer.weight.dtype == FP8
    torch.testing.assert_close(layer.weight_scale, source.abs().amax(1, keepdim=True) / 448, rtol=0, atol=0)
    error = (layer.method.dequantized_weight(layer) - source).abs()
    assert (error <= fp8_rounding_bound(source, layer.weight_scale)).all()
    assert error.max() > 0  # it did quantize


def test_fp8_cpu_product_is_the_dequantized_activations_times_the_dequantized_weights() -> None:
    torch.manual_seed(1)
    layer = Linear(64, [48], bias=True, parallel="column", tp=TPInfo(), method=Fp8Method(Fp8Scheme()))
    layer.method.load(layer, "weight", Source(torch.randn(48, 64)), "w", 0)
    layer.method.load(layer, "bias", Source(torch.randn(48)), "b", 0)
    x = torch.randn(5, 64) * torch.tensor([[0.01], [1], [100], [3], [0.5]])  # per-token ranges
    xq, xs = quantize_fp8(x)
    expected = F.linear(xq.float() * xs, layer.weight.float() * layer.weight_scale, layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer(QuantizedInput(xq, xs)), expected, rtol=1e-6, atol=1e-6)
    # per-token scales: every row keeps FP8's relative precision, whatever its range
    exact = F.linear(x, layer.method.dequantized_weight(layer), layer.bias)
    relative = (layer(x) - exact).norm(dim=1) / exact.norm(dim=1)
    assert relative.max() < 0.05


def test_static_input_scales_take_the_largest_of_the_fused_shards() -> None:
    scheme = Fp8Scheme(prequantized=True, static_input=True)
    layer = Linear(32, [16, 8, 8], bias=False, parallel="column", tp=TPInfo(), method=Fp8Method(scheme))
    for shard, (rows, scale) in enumerate(((16, 0.5), (8, 2.0), (8, 0.25))):
        w, s = quantize_fp8(torch.randn(rows, 32))
        layer.method.load(layer, "weight", Source(w), "w", shard)
        layer.method.load(layer, "weight_scale", Source(torch.tensor([0.1 * (shard + 1)])), "ws", shard)
        layer.method.load(layer, "input_scale", Source(torch.tensor([scale])), "is", shard)
    layer.method.process_after_loading(layer)
    assert layer.static_scale.tolist() == [2.0]
    # a per-tensor weight scale covers every row of its shard
    assert layer.weight_scale[:16].unique().tolist() == [0.10000000149011612]
    assert layer.weight_scale[24:].unique().tolist() == [0.30000001192092896]
    x = torch.randn(3, 32)
    q, scales = quantize_fp8(x, layer.static_scale)
    assert scales.flatten().tolist() == [2.0] * 3
    torch.testing.assert_close(layer(x), layer(QuantizedInput(q, scales)))
