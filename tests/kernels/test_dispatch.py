"""ops.select: CUDA (or KVPILOT_KERNELS=triton) gets the Triton ops, KVPILOT_KERNELS=reference
the reference (CPU routing to the compiled CPU ops: test_cpu_ops.py); the environment switches
are resolved there, once, and a bad value fails there."""

from __future__ import annotations

import pytest
import torch
from paged_batches import head_major_batch, make_batch, rel_err, step_plan, tolerance

from kvpilot.kernels import ops, reference
from kvpilot.kernels.cpu_ops import CpuOps
from kvpilot.kernels.paged_attention import tma_decode
from kvpilot.kernels.reference import ReferenceOps
from kvpilot.kernels.triton_ops import TritonOps


def test_env_forces_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_KERNELS", "reference")
    assert type(ops.select("cpu")) is ReferenceOps


def test_cuda_uses_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPILOT_KERNELS", raising=False)
    assert isinstance(ops.select("cuda"), TritonOps)


def test_env_forces_triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_KERNELS", "triton")
    assert isinstance(ops.select("cpu"), TritonOps)


def test_env_forces_reference_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_KERNELS", "reference")
    assert type(ops.select("cuda")) is ReferenceOps


def test_unknown_env_value_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KVPILOT_KERNELS must be one of auto, triton, cpu, reference, not 'cuda'"):
        ops.select("cpu")


def test_unknown_tma_switch_value_fails_when_the_ops_are_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked when the runner picks its ops, on any device, not at the first decode step."""
    monkeypatch.setenv("KVPILOT_DECODE_TMA", "yes")
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match="KVPILOT_DECODE_TMA must be one of graphs, 1, 0, not 'yes'"):
            ops.select(device)


@pytest.mark.parametrize(("switch", "eager", "graphs"), [
    (None, False, True), ("graphs", False, True), ("1", True, True), ("0", False, False),
])
def test_tma_switch_becomes_the_triton_ops_fields(
    switch: str | None, eager: bool, graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if switch is None:
        monkeypatch.delenv("KVPILOT_DECODE_TMA", raising=False)
    else:
        monkeypatch.setenv("KVPILOT_DECODE_TMA", switch)
    impl = ops.select("cuda")
    assert impl == TritonOps(prefer_tma=eager, graphs_prefer_tma=graphs)
    assert impl.for_graphs() == TritonOps(prefer_tma=graphs, graphs_prefer_tma=graphs)


def test_only_the_triton_ops_record_other_kernels_into_graphs() -> None:
    for impl in (ReferenceOps(), CpuOps()):
        assert impl.for_graphs() is impl


def test_attention_calls_take_the_switch_from_the_ops_not_the_environment(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton ops picked under KVPILOT_DECODE_TMA=0 never take the TMA kernel, even in graphs
    and with the variable changed since; those picked under the default take it in graphs only.
    Every output is checked; the TMA launcher is wrapped, not replaced, to see which kernel ran."""
    launches: list[int] = []
    real = tma_decode.launch
    monkeypatch.setattr(tma_decode, "launch", lambda *args: launches.append(1) or real(*args))
    monkeypatch.setenv("KVPILOT_KERNELS", "triton")
    monkeypatch.setenv("KVPILOT_DECODE_TMA", "0")
    off = ops.select(device)
    monkeypatch.delenv("KVPILOT_DECODE_TMA")
    default = ops.select(device)
    monkeypatch.setenv("KVPILOT_DECODE_TMA", "1")
    batch = head_major_batch(make_batch([(1, 1), (17, 1), (65, 1)], 8, 2, 64, 16, torch.float32, device))
    expected = reference.paged_attention(*batch, 0.125)
    for impl, takes_tma in [(off, False), (off.for_graphs(), False), (default, False), (default.for_graphs(), True)]:
        before = len(launches)
        out = impl.paged_attention(batch[0], batch[1], batch[2], step_plan(batch), 0.125)
        assert rel_err(out, expected) < tolerance(torch.float32, device)
        assert len(launches) - before == takes_tma, impl
