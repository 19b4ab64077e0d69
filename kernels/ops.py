"""The one op interface the model runner calls; it picks an implementation by device.

CUDA tensors go to the Triton kernels (`triton_ops`) when they exist and import; CPU tensors go to
`cpu_ops` (float32 kernels in C: decode attention, norms, rotary, cache writes) when its C file
builds on this machine, else to the plain-torch reference (`reference`). `KVPILOT_KERNELS=triton`
forces Triton (tests set it together with `TRITON_INTERPRET=1` to run the kernels on CPU);
`KVPILOT_KERNELS=cpu` forces `cpu_ops` (an error where it cannot build);
`KVPILOT_KERNELS=reference` forces the reference everywhere; `KVPILOT_DECODE_TMA` (`tma_switch`)
says where the Triton paged attention takes its TMA decode kernel. Signatures and layouts are those of
`reference.py`.

The index tensors of a step (positions, slot_mapping, block_tables, seq_lens, query_start_loc)
are read-only once passed to an op: the reference plans its index work once per step and reuses
it for every layer called with the same tensor objects. New contents come in new tensors.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kvpilot.kernels import cpu_ops, reference

_OPS = ("paged_attention", "write_kv_cache", "rms_norm", "fused_add_rms_norm", "rotary_embedding")


def _triton() -> ModuleType | None:
    try:
        from kvpilot.kernels import triton_ops
    except ImportError:
        return None
    return triton_ops


def select(device: torch.device | str) -> ModuleType:
    """The module whose functions implement the ops for tensors on `device`."""
    choice = os.environ.get("KVPILOT_KERNELS", "auto")
    if choice not in ("auto", "triton", "cpu", "reference"):
        raise ValueError(f"KVPILOT_KERNELS must be auto, triton, cpu or reference, not {choice!r}")
    tma_switch()  # a bad value fails here, when the runner starts, not at its first decode step
    if choice == "reference":
        return reference
    if choice == "cpu":
        if not cpu_ops.available():
            raise RuntimeError("KVPILOT_KERNELS=cpu but the CPU kernels did not build (see the log)")
        return cpu_ops
    wants_triton = choice == "triton" or torch.device(device).type == "cuda"
    if wants_triton:
        impl = _triton()
        if impl is not None and all(hasattr(impl, name) for name in _OPS):
            return impl
        if choice == "triton":
            raise RuntimeError("KVPILOT_KERNELS=triton but kvpilot.kernels.triton_ops is unavailable")
    if torch.device(device).type == "cpu" and cpu_ops.available():
        return cpu_ops
    return reference


def for_graphs(impl: ModuleType) -> ModuleType:
    """The ops to record into a CUDA graph in place of `impl`'s: the Triton ops pick kernels that
    run faster on the device but cost more host time to launch (`triton_graph_ops`); the others
    are the same either way."""
    if impl is not _triton():
        return impl
    from kvpilot.kernels import triton_graph_ops
    return triton_graph_ops


TMA_SWITCH = "KVPILOT_DECODE_TMA"
TMA_SWITCH_VALUES = ("graphs", "1", "0")


def tma_switch() -> str:
    """Where the Triton paged attention takes its TMA decode kernel (kernels/paged_attention.py):
    `graphs` (the default) in launches recorded into CUDA graphs, `1` everywhere, `0` nowhere."""
    value = os.environ.get(TMA_SWITCH, "graphs")
    if value not in TMA_SWITCH_VALUES:
        raise ValueError(f"{TMA_SWITCH} must be one of {', '.join(TMA_SWITCH_VALUES)}, not {value!r}")
    return value
