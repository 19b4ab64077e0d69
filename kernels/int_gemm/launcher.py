"""Host side of the integer-weight products: argument checks, tiles per shape, and which kernel
serves a batch: 4-bit weights up to decode_int4.MAX_M rows take `decode_int4.py` (zero point and
scale per group, not per weight), other weights up to DECODE_MAX_M rows `decode.py` (both bound by
the weights' bytes), larger batches `prefill.py` (bound by the tensor cores)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpilot.kernels.checks import FLOAT_DTYPES, check_tensor
from kvpilot.kernels.host import cdiv, next_power_of_2
from kvpilot.kernels.int_gemm import decode, decode_int4, prefill, splits
from kvpilot.kernels.int_gemm.decode import DecodeConfig
from kvpilot.kernels.int_gemm.decode_int4 import Int4DecodeConfig
from kvpilot.kernels.int_gemm.layout import IntWeight
from kvpilot.kernels.int_gemm.prefill import PrefillConfig

DECODE_MAX_M = 64
BLOCK_NS = (64, 32, 16)  # decode column tiles, widest first
MAX_SPLIT = 8
INT4_STEPS = 8  # block_k steps a 4-bit decode program walks at most, where K allows (choose_int4_decode)


def check(x: torch.Tensor, w: IntWeight) -> None:
    """The activations against the weight (which checked itself when made)."""
    check_tensor("x", x, 2, FLOAT_DTYPES, w.qweight.device)
    if x.shape[1] != w.in_features:
        raise ValueError(f"x has {x.shape[1]} features, the weight takes {w.in_features}")


def block_k_for(group_size: int, wanted: int) -> int:
    """The largest power of two <= wanted that divides group_size: a tile then never straddles two
    groups, so one row of scales and zeros serves it."""
    block = 1 << (wanted.bit_length() - 1)
    while block > 1 and group_size % block:
        block //= 2
    return block


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def choose_decode(m: int, w: IntWeight, num_sms: int) -> DecodeConfig:
    """The widest column tile that still gives two programs per SM (narrower tiles read shorter
    runs per row); K is split only where even the narrowest leaves SMs idle, since the partials'
    sum costs two more launches."""
    block_k = block_k_for(w.group_size, DecodeConfig.block_k)
    n = w.out_features
    block_n = next((b for b in BLOCK_NS if cdiv(n, b) >= 2 * num_sms), BLOCK_NS[-1])
    split = 1
    while cdiv(n, block_n) * split < num_sms and w.in_features % (2 * split * block_k) == 0 and split < MAX_SPLIT:
        split *= 2
    return DecodeConfig(block_n=block_n, block_k=block_k, split_k=split)


def choose_int4_decode(m: int, w: IntWeight, num_sms: int) -> Int4DecodeConfig:
    """The default variant and tile (decode_int4's docstring), K split until each program walks at
    most INT4_STEPS steps of block_k (up to MAX_SPLIT slices) or, with few column tiles, until every
    SM has a program: a program's steps run one after another, each waiting on its loads and its
    product (the split benchmarks/bench_int4_gpu.py's sweep found fastest), and the partials'
    sum costs one more launch."""
    block_k = block_k_for(w.group_size, Int4DecodeConfig.block_k)
    tiles_n = cdiv(w.out_features, Int4DecodeConfig.block_n)
    split = 1
    while (w.in_features // (split * block_k) > INT4_STEPS or tiles_n * split < num_sms) \
            and w.in_features % (2 * split * block_k) == 0 and split < MAX_SPLIT:
        split *= 2
    return Int4DecodeConfig(block_k=block_k, split_k=split)


def int4_decode_serves(m: int, w: IntWeight) -> bool:
    return w.bits == 4 and m <= decode_int4.MAX_M


def choose_prefill(m: int, w: IntWeight) -> PrefillConfig:
    if m >= 128:
        return PrefillConfig()
    return PrefillConfig(block_m=64, num_warps=4)


def int_gemm_decode(x: torch.Tensor, w: IntWeight, config: DecodeConfig | Int4DecodeConfig | None = None
                    ) -> torch.Tensor:
    """x (M, K) @ W^T -> (M, N) in x's dtype, by a decode kernel (any M; meant for M <= 64):
    `decode_int4.py` for an Int4DecodeConfig, or, without a config, where it serves the batch;
    `decode.py` otherwise."""
    check(x, w)
    m, n = x.shape[0], w.out_features
    if config is None and int4_decode_serves(m, w):
        config = choose_int4_decode(m, w, _num_sms(x.device))
    if isinstance(config, Int4DecodeConfig):
        return _int4_decode(x, w, config)
    config = config or choose_decode(m, w, _num_sms(x.device))
    block_k = block_k_for(w.group_size, config.block_k)
    if w.in_features % (config.split_k * block_k):
        raise ValueError(f"split_k {config.split_k} x block_k {block_k} must divide in_features {w.in_features}")
    block_m = max(16, next_power_of_2(min(m, DECODE_MAX_M)))
    return _split_k(x, n, config.split_k, lambda out: decode.launch(x, w, out, config, block_m, block_k))


def _int4_decode(x: torch.Tensor, w: IntWeight, config: Int4DecodeConfig) -> torch.Tensor:
    m, n = x.shape[0], w.out_features
    if w.bits != 4 or m > decode_int4.MAX_M:
        raise ValueError(f"the 4-bit decode kernel takes 4-bit weights and at most {decode_int4.MAX_M} rows, "
                         f"got {w.bits}-bit and {m}")
    block_k = block_k_for(w.group_size, config.block_k)
    if config.order == 2 and block_k < 128:
        raise ValueError(f"order 2 needs block_k >= 128; group size {w.group_size} allows {block_k}")
    if w.in_features % (config.split_k * block_k):
        raise ValueError(f"split_k {config.split_k} x block_k {block_k} must divide in_features {w.in_features}")
    return _split_k(x, n, config.split_k, lambda out: decode_int4.launch(x, w, out, config, block_k))


def _split_k(x: torch.Tensor, n: int, split_k: int, launch: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """A decode kernel's (M, N) output in x's dtype: `launch(out)` writes it, or with split_k > 1
    its (split_k, M, N) float32 partials, which one more launch sums and rounds."""
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if split_k == 1:
        launch(out)
        return out
    partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    launch(partials)
    splits.sum_splits(partials, out)
    return out


def int_gemm_prefill(x: torch.Tensor, w: IntWeight, config: PrefillConfig | None = None) -> torch.Tensor:
    """x (M, K) @ W^T -> (M, N) in x's dtype, by the tiled kernel."""
    check(x, w)
    m, n = x.shape[0], w.out_features
    config = config or choose_prefill(m, w)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        prefill.launch(x, w, out, config, block_k_for(w.group_size, config.block_k))
    return out


def int_gemm(x: torch.Tensor, w: IntWeight) -> torch.Tensor:
    """x (M, K) @ W^T -> (M, N) in x's dtype, by the kernel that suits M."""
    return int_gemm_decode(x, w) if x.shape[0] <= DECODE_MAX_M else int_gemm_prefill(x, w)


