"""AWQ's and GPTQ's on-disk integer layouts, both ways: read into kvpilot's packed layout
(`kvpilot.kernels.int_gemm.IntWeight`), and written from a round-to-nearest quantisation (`rtn.py`)
for tests, the accuracy benchmark and dummy weights.

For a linear layer with K inputs, N outputs and groups of g inputs (checkpoint tensor names):
* AWQ, AutoAWQ's GEMM version (4-bit, zero points): `qweight` (K, N / 8) int32 packs 8 outputs of
  one input per word in the interleaved order AWQ_ORDER (nibble i holds output 8j + AWQ_ORDER[i]);
  `qzeros` (K / g, N / 8) int32 the same way; `scales` (K / g, N) float16.
  W[n, k] = (q - zero) * scale.
* GPTQ, the AutoGPTQ/GPTQModel layout (`checkpoint_format: gptq`, 4- or 8-bit): `qweight`
  (K / pack, N) int32 packs `pack` = 32 / bits consecutive inputs of one output per word, lowest
  bits first; `qzeros` (K / g, N / pack) int32 packs outputs the same way and stores zero - 1 (the
  original kernels add the 1 back; `gptq_v2` stores the zero itself); `scales` (K / g, N) float16;
  `g_idx` (K,) int32, each input's group: k // g, or with `desc_act` (act-order) the groups of
  the order in which GPTQ quantised the inputs. Symmetric checkpoints store zero 2**(bits - 1).
"""

from __future__ import annotations

import torch

from kvpilot.kernels.int_gemm import IntWeight, pack_rows, unpack_rows
from kvpilot.runtime.executor.quant.rtn import RtnWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_BITS = 4


def _awq_columns(n: int, device: torch.device) -> torch.Tensor:
    """Index of the output held by each unpacked nibble position (8j + i -> 8j + AWQ_ORDER[i])."""
    order = torch.tensor(AWQ_ORDER, device=device)
    return (torch.arange(0, n, 8, device=device)[:, None] + order).reshape(-1)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """(R, C / 8) int32 in AWQ's interleaved order -> (R, C) int32."""
    nibbles = unpack_rows(packed, AWQ_BITS)  # position 8j + i = nibble i of word j
    out = torch.empty_like(nibbles)
    out[:, _awq_columns(nibbles.shape[1], packed.device)] = nibbles
    return out


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """(R, C) integers in [0, 16) -> (R, C / 8) int32 in AWQ's interleaved order."""
    return pack_rows(q[:, _awq_columns(q.shape[1], q.device)], AWQ_BITS)


def awq_to_int_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                      dtype: torch.dtype) -> IntWeight:
    """AWQ's tensors (see the module docstring) -> kvpilot's layout, scales and zeros in `dtype`."""
    q = unpack_awq(qweight)  # (K, N)
    return IntWeight(pack_rows(q.t(), AWQ_BITS), scales.to(dtype).contiguous(),
                     unpack_awq(qzeros).to(dtype), AWQ_BITS, group_size)


def awq_tensors(w: RtnWeight) -> dict[str, torch.Tensor]:
    """An RTN quantisation as AWQ stores it."""
    return {"qweight": pack_awq(w.q.t()), "qzeros": pack_awq(w.zeros), "scales": w.scales.to(torch.float16)}


def gptq_to_int_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                       bits: int, group_size: int, zero_offset: int, dtype: torch.dtype) -> IntWeight:
    """GPTQ's tensors -> kvpilot's layout. `zero_offset` is added to the stored zeros (1 for the
    `gptq` format). With act-order the inputs are sorted by group: the packed columns follow
    that order and `perm` says which input each one is; g_idx must then give every group
    group_size inputs, which GPTQ's act-order always does."""
    k = qweight.shape[0] * 32 // bits
    q = unpack_rows(qweight.t(), bits)  # (N, K): GPTQ packs along K, as kvpilot does, but (K/pack, N)
    # a stored 15 with the gptq format's offset is zero point 16, as its own kernels read it
    zeros = (unpack_rows(qzeros, bits) + zero_offset).to(dtype)
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(device=q.device, dtype=torch.int64)
        in_order = torch.arange(k, device=q.device) // group_size
        if not torch.equal(g_idx, in_order):
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], in_order):
                raise ValueError(f"g_idx does not give each group {group_size} inputs")
            q, perm = q[:, order], order.to(torch.int32)
    return IntWeight(pack_rows(q, bits), scales.to(dtype).contiguous(), zeros, bits, group_size, perm)


def gptq_tensors(w: RtnWeight, bits: int, zero_offset: int, perm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """An RTN quantisation as GPTQ stores it; with `perm` (act-order), the order in which GPTQ
    took the inputs: w's groups are then groups of that order, and g_idx maps each input to its
    group. `w` holds the integers in the inputs' own order."""
    k = w.q.shape[1]
    group_size = k // w.scales.shape[0]
    in_order = torch.arange(k, dtype=torch.int32, device=w.q.device) // group_size
    g_idx = in_order
    if perm is not None:
        g_idx = torch.empty_like(in_order)
        g_idx[perm.long()] = in_order
    stored_zeros = w.zeros - zero_offset
    if bool((stored_zeros < 0).any()):
        raise ValueError("the gptq format cannot store a zero point of 0 (it stores zero - 1): write gptq_v2")
    return {"qweight": pack_rows(w.q, bits).t().contiguous(), "qzeros": pack_rows(stored_zeros, bits),
            "scales": w.scales.to(torch.float16), "g_idx": g_idx}
