"""ops.select routes CUDA (or KVPILOT_KERNELS=triton) to Triton and KVPILOT_KERNELS=reference to
the reference (CPU routing to the compiled CPU ops: test_cpu_ops.py)."""

from __future__ import annotations

import pytest

from kvpilot.kernels import cpu_ops, ops, reference, triton_graph_ops, triton_ops


def test_env_forces_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_KERNELS", "reference")
    assert ops.select("cpu") is reference


def test_cuda_uses_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPILOT_KERNELS", raising=False)
    assert ops.select("cuda") is triton_ops


def test_env_forces_triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_KERNELS", "triton")
    assert ops.select("cpu") is triton_ops


def test_env_forces_reference_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_KERNELS", "reference")
    assert ops.select("cuda") is reference


def test_unknown_env_value_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KVPILOT_KERNELS"):
        ops.select("cpu")


def test_triton_ops_defines_every_op() -> None:
    for name in ("paged_attention", "write_kv_cache", "rms_norm", "fused_add_rms_norm", "rotary_embedding"):
        assert callable(getattr(triton_ops, name))


def test_graphs_record_triton_attention_as_captured_and_the_rest_unchanged() -> None:
    graph_ops = ops.for_graphs(triton_ops)
    assert graph_ops is triton_graph_ops
    for name in ("write_kv_cache", "rms_norm", "fused_add_rms_norm", "rotary_embedding"):
        assert getattr(graph_ops, name) is getattr(triton_ops, name)
    assert graph_ops.paged_attention.func is triton_ops.paged_attention
    assert graph_ops.paged_attention.keywords == {"in_graph": True}
    for impl in (reference, cpu_ops):
        assert ops.for_graphs(impl) is impl


def test_unknown_tma_switch_value_fails_when_the_ops_are_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked when the runner picks its ops, on any device, not at the first decode step."""
    monkeypatch.setenv("KVPILOT_DECODE_TMA", "yes")
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match="KVPILOT_DECODE_TMA must be one of graphs, 1, 0, not 'yes'"):
            ops.select(device)
