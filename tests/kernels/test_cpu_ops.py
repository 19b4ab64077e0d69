"""cpu_ops: the compiled CPU kernels equal the reference (and float64 dense attention), in the
engine's strided layouts; wrong sizes raise instead of reading out of bounds; without a compiler
the ops fall back to the reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from paged_batches import DECODE, MIXED, dense_float64, make_batch, step_plan

from kvpilot.kernels import cpu_ops, ops, reference
from kvpilot.kernels.cpu_ops import CpuOps
from kvpilot.kernels.step_plan import StepPlan
from kvpilot.runtime.tunables import BLOCK_SIZES

# what the child interpreters need to import kvpilot as this one does (an install, or a folder of
# import-name links on PYTHONPATH as benchmarks/run_on_gpu.sh makes)
IMPORTS = {"PYTHONSAFEPATH": "1", **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler on this machine")

CPU = CpuOps()


def attention(batch: tuple[torch.Tensor, ...], scale: float) -> torch.Tensor:
    return CPU.paged_attention(batch[0], batch[1], batch[2], step_plan(batch), scale)  # type: ignore[arg-type]


def rotary_plan(positions: torch.Tensor, cos_sin: torch.Tensor) -> StepPlan:
    """A decode step of len(positions) one-token sequences, for the rotary op."""
    n = positions.numel()
    return StepPlan(positions, torch.full((n,), -1), torch.zeros((n, 1), dtype=torch.int32),
                    torch.ones(n, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32), 1, cos_sin, 16)


def write_plan(slots: torch.Tensor, block_size: int) -> StepPlan:
    n = slots.numel()
    return StepPlan(torch.zeros(n, dtype=torch.long), slots, torch.zeros((n, 1), dtype=torch.int32),
                    torch.ones(n, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32), 1,
                    torch.zeros(1, 2), block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("specs", [DECODE, MIXED, [(300, 1), (1, 1), (129, 1)]], ids=["decode", "mixed", "long"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (8, 1, 80)])
def test_paged_attention_equals_reference_and_float64(
    block_size: int, specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
) -> None:
    scale = head_dim ** -0.5
    batch = make_batch(specs, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu")
    torch.testing.assert_close(attention(batch, scale), reference.paged_attention(*batch, scale),
                               rtol=1e-5, atol=1e-5)
    # every cache slot outside a context NaN: a read past a context would show
    poisoned = make_batch(specs, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu",
                          poison_unused=True)
    torch.testing.assert_close(attention(poisoned, scale).double(), dense_float64(poisoned, scale),
                               rtol=1e-5, atol=1e-5)


def test_paged_attention_reads_strided_q_and_head_major_caches() -> None:
    """The engine passes q as a view into the fused qkv rows and the GPU-style cache layout works too."""
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(DECODE + MIXED, 8, 2, 64, 16, torch.float32, "cpu")
    qkv = torch.randn(q.shape[0], (8 + 4) * 64)
    qkv[:, :8 * 64] = q.flatten(1)
    q_view = qkv[:, :8 * 64].view(q.shape)
    head_major = [reference.kv_cache_empty(*k_cache.shape, head_major=True, dtype=torch.float32, device="cpu")
                  for _ in range(2)]
    head_major[0].copy_(k_cache)
    head_major[1].copy_(v_cache)
    got = attention((q_view, *head_major, tables, seq_lens, qsl), 0.125)
    torch.testing.assert_close(got, reference.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125),
                               rtol=1e-5, atol=1e-5)


def test_paged_attention_of_other_dtypes_is_the_reference() -> None:
    batch = make_batch(DECODE, 4, 2, 64, 16, torch.bfloat16, "cpu")
    torch.testing.assert_close(attention(batch, 0.125), reference.paged_attention(*batch, 0.125))


def test_norms_equal_the_reference_on_strided_rows() -> None:
    base = torch.randn(70, 600)
    x, weight = base[:, :576], torch.randn(576)  # row stride 600
    torch.testing.assert_close(CPU.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5),
                               rtol=2e-6, atol=2e-6)
    h, residual = torch.randn(16, 576), torch.randn(16, 576)
    h2, residual2 = h.clone(), residual.clone()
    CPU.fused_add_rms_norm(h, residual, weight, 1e-5)
    reference.fused_add_rms_norm(h2, residual2, weight, 1e-5)
    assert torch.equal(residual, residual2)  # one rounding per element either way
    torch.testing.assert_close(h, h2, rtol=2e-6, atol=2e-6)


def test_rotary_is_bit_identical_to_the_reference() -> None:
    qkv = torch.randn(33, (6 + 2 * 2) * 64)
    q, k = qkv[:, :384].view(33, 6, 64), qkv[:, 384:512].view(33, 2, 64)
    positions = torch.randint(0, 100, (33,))
    cos_sin = torch.randn(100, 64)
    q2, k2 = q.clone(), k.clone()
    CPU.rotary_embedding(q, k, rotary_plan(positions, cos_sin))
    reference.rotary_embedding(positions, q2, k2, cos_sin)
    assert torch.equal(q, q2) and torch.equal(k, k2)


@pytest.mark.parametrize("head_major", [False, True])
def test_write_kv_cache_equals_the_reference_and_skips_padding(head_major: bool) -> None:
    caches = [reference.kv_cache_empty(6, 8, 2, 64, head_major=head_major, dtype=torch.float32, device="cpu")
              for _ in range(4)]
    kv = torch.randn(5, 2 * 2 * 64)
    k, v = kv[:, :128].view(5, 2, 64), kv[:, 128:].view(5, 2, 64)
    slots = torch.tensor([3, -1, 17, 47, 8])
    CPU.write_kv_cache(k, v, caches[0], caches[1], write_plan(slots, 8))
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].count_nonzero() == 4 * 2 * 64  # the padding row wrote nothing


def test_mismatched_sizes_raise_instead_of_reading_out_of_bounds() -> None:
    with pytest.raises(ValueError, match="weight size vs hidden size"):
        CPU.rms_norm(torch.randn(4, 64), torch.randn(32), 1e-5)
    with pytest.raises(ValueError, match="cos_sin_cache width"):
        CPU.rotary_embedding(torch.randn(2, 4, 64), torch.randn(2, 2, 64),
                             rotary_plan(torch.zeros(2, dtype=torch.long), torch.randn(10, 32)))
    with pytest.raises(ValueError, match="slot_mapping vs k tokens"):
        CPU.write_kv_cache(torch.randn(3, 2, 64), torch.randn(3, 2, 64), torch.zeros(4, 8, 2, 64),
                           torch.zeros(4, 8, 2, 64), write_plan(torch.zeros(2, dtype=torch.long), 8))


def test_cpu_tensors_use_the_compiled_ops_when_they_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPILOT_KERNELS", raising=False)
    assert isinstance(ops.select("cpu"), CpuOps)
    monkeypatch.setenv("KVPILOT_KERNELS", "cpu")
    assert isinstance(ops.select("cpu"), CpuOps)


def test_without_a_compiler_cpu_falls_back_to_the_reference(tmp_path: pytest.TempPathFactory) -> None:
    """A fresh process with no usable compiler and an empty build folder: the reference, one warning."""
    code = ("import logging; logging.basicConfig(); from kvpilot.kernels import ops, reference; "
            "assert type(ops.select('cpu')) is reference.ReferenceOps; print('fell back')")
    env = {"CC": "/nonexistent/cc", "KVPILOT_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin",
           "KVPILOT_KERNELS": "auto", **IMPORTS}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "fell back" in proc.stdout
    assert "CPU kernels unavailable" in proc.stderr and "/nonexistent/cc" in proc.stderr
    forced = subprocess.run([sys.executable, "-c", "from kvpilot.kernels import ops; ops.select('cpu')"],
                            env={**env, "KVPILOT_KERNELS": "cpu"}, capture_output=True, text=True, check=False)
    assert forced.returncode != 0 and "KVPILOT_KERNELS=cpu" in forced.stderr


def test_the_build_is_reused_across_processes(tmp_path: pytest.TempPathFactory) -> None:
    code = "from kvpilot.kernels import cpu_ops; assert cpu_ops.available()"
    env = {"KVPILOT_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", **IMPORTS}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    (built,) = (tmp_path / "cpu-kernels").glob("*.so")  # type: ignore[operator]
    first = built.stat().st_mtime_ns
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert built.stat().st_mtime_ns == first  # loaded, not rebuilt
