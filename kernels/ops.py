"""Which implementation of the ops (`interface.Ops`) a model runner gets.

CUDA tensors go to the Triton kernels (`triton_ops`) when they import; CPU tensors go to
`cpu_ops` (float32 kernels in C: decode attention, norms, rotary, cache writes) when its C file
builds on this machine, else to the plain-torch reference (`reference`).

Two environment switches are read here, once, when the runner picks its ops; a bad value stops
the start with one message naming the variable, and nothing reads them again:
* `KVPILOT_KERNELS`: `auto` (the default, as above), `triton` (forces Triton: tests set it
  together with `TRITON_INTERPRET=1` to run the kernels on CPU), `cpu` (forces `cpu_ops`, an
  error where it cannot build) or `reference` (the reference everywhere);
* `KVPILOT_DECODE_TMA`: where the Triton paged attention takes its TMA decode kernel: `graphs`
  (the default) in launches recorded into CUDA graphs, `1` everywhere, `0` nowhere.
"""

from __future__ import annotations

import os

import torch

from kvpilot.kernels import cpu_ops
from kvpilot.kernels.cpu_ops import CpuOps
from kvpilot.kernels.interface import Ops
from kvpilot.kernels.reference import ReferenceOps
from kvpilot.kernels.step_plan import AttentionInputs, StepPlan

__all__ = ["AttentionInputs", "Ops", "StepPlan", "select"]

KERNELS_SWITCH = "KVPILOT_KERNELS"
KERNELS_VALUES = ("auto", "triton", "cpu", "reference")
TMA_SWITCH = "KVPILOT_DECODE_TMA"
# value -> (prefer_tma, graphs_prefer_tma) of TritonOps
TMA_VALUES = {"graphs": (False, True), "1": (True, True), "0": (False, False)}


def _switch(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    return value


def _triton(tma: str) -> Ops | None:
    try:
        from kvpilot.kernels.triton_ops import TritonOps
    except ImportError:
        return None
    prefer_tma, graphs_prefer_tma = TMA_VALUES[tma]
    return TritonOps(prefer_tma=prefer_tma, graphs_prefer_tma=graphs_prefer_tma)


def select(device: torch.device | str) -> Ops:
    """The ops for tensors on `device`, with the environment switches resolved."""
    choice = _switch(KERNELS_SWITCH, "auto", KERNELS_VALUES)
    # checked on any device: a bad value fails when the runner starts, not at its first decode step
    tma = _switch(TMA_SWITCH, "graphs", tuple(TMA_VALUES))
    if choice == "reference":
        return ReferenceOps()
    if choice == "cpu":
        if not cpu_ops.available():
            raise RuntimeError("KVPILOT_KERNELS=cpu but the CPU kernels did not build (see the log)")
        return CpuOps()
    wants_triton = choice == "triton" or torch.device(device).type == "cuda"
    if wants_triton:
        impl = _triton(tma)
        if impl is not None:
            return impl
        if choice == "triton":
            raise RuntimeError("KVPILOT_KERNELS=triton but kvpilot.kernels.triton_ops is unavailable")
    if torch.device(device).type == "cpu" and cpu_ops.available():
        return CpuOps()
    return ReferenceOps()
