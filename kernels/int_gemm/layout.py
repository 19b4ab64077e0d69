"""`IntWeight`, the packed layout of the package docstring, with its plain-torch twin: packing,
unpacking, de-quantising, and `int_linear_reference` (de-quantise, then `F.linear`), which the
kernels are tested against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BITS = (4, 8)
MIN_GROUP = 16  # tl.dot's smallest reduction: a tile never straddles two groups


@dataclass(frozen=True)
class IntWeight:
    """Checked when made (the launchers then check only the activations)."""

    qweight: torch.Tensor  # (N, K // pack) int32
    scales: torch.Tensor  # (K // group_size, N)
    zeros: torch.Tensor  # (K // group_size, N), scales' dtype
    bits: int
    group_size: int
    perm: torch.Tensor | None = None  # (K,) int32: the input feature of each packed column

    @property
    def pack(self) -> int:
        """Integers per int32 word."""
        return 32 // self.bits

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * self.pack

    def __post_init__(self) -> None:
        """The layout's invariants, as ValueErrors naming the tensor."""
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if self.qweight.dtype != torch.int32 or self.qweight.dim() != 2:
            raise ValueError(f"qweight must be 2-D int32, got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        n, k = self.out_features, self.in_features
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"group_size {self.group_size} must divide in_features {k}")
        if self.group_size % MIN_GROUP:
            raise ValueError(f"group_size {self.group_size} must be a multiple of {MIN_GROUP}")
        groups = (k // self.group_size, n)
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if tuple(t.shape) != groups:
                raise ValueError(f"{name} must have shape {groups}, got {tuple(t.shape)}")
            if t.device != self.qweight.device:
                raise ValueError(f"{name} is on {t.device}, qweight on {self.qweight.device}")
        if self.zeros.dtype != self.scales.dtype:
            raise ValueError(f"zeros dtype {self.zeros.dtype} differs from scales dtype {self.scales.dtype}")
        if self.perm is not None and (tuple(self.perm.shape) != (k,) or self.perm.dtype != torch.int32):
            raise ValueError(f"perm must be ({k},) int32, got {self.perm.dtype} {tuple(self.perm.shape)}")


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, K) integers in [0, 2**bits) -> (N, K // pack) int32, packed along K as the layout says."""
    pack = 32 // bits
    n, k = q.shape
    if k % pack:
        raise ValueError(f"K ({k}) must be a multiple of {pack} to pack {bits}-bit values")
    shifts = torch.arange(pack, device=q.device, dtype=torch.int64) * bits
    words = (q.to(torch.int64).view(n, k // pack, pack) << shifts).sum(-1)
    # the words are unsigned 32-bit patterns: wrap those past int32's range to its negatives
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_rows`: (N, K // pack) int32 -> (N, K) int32."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits
    # arithmetic shifts copy the sign bit down; the mask drops it
    q = (qweight.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(qweight.shape[0], -1)


def dequantize(w: IntWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The (N, K) matrix in nn.Linear's orientation and the inputs' own order, computed in
    float32 (exact: small integers times the scales) and rounded once to `dtype` (scales' dtype
    when None)."""
    q = unpack_rows(w.qweight, w.bits).float()
    scales = w.scales.float().repeat_interleave(w.group_size, dim=0).t()  # (N, K)
    zeros = w.zeros.float().repeat_interleave(w.group_size, dim=0).t()
    dense = ((q - zeros) * scales).to(dtype or w.scales.dtype)
    if w.perm is None:
        return dense
    out = torch.empty_like(dense)
    out[:, w.perm.long()] = dense
    return out


def int_linear_reference(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N): de-quantise to x's dtype, then `F.linear`."""
    return F.linear(x, dequantize(w, x.dtype), bias)
