"""CPU implementation of the ops: float32 kernels compiled from C, the reference for the rest.

On the 2-core CPU a decode step of the embedded model spent about a third of its time outside
the matrix products: attention, where the reference gathers each sequence's cache blocks into a
copy padded to the longest context and runs SDPA over it (every K/V byte read twice and written
once), and chains of small torch ops (norms, rotary, cache writes) that cost several microseconds
each before doing any work. `csrc/cpu_kernels.c` reads the cache blocks in place through the
block table (one (sequence, KV head) per OpenMP work item) and does each norm, rotation and cache
write in one call.

The C file is compiled on first use with the system C compiler (`$CC`, else `cc`) into
`$KVPILOT_CACHE/cpu-kernels/` (default ~/.cache/kvpilot), keyed by a hash of the source and the
flags, and loaded with ctypes; later processes load the built library. `-fopenmp` links against
libgomp.so.1, which torch has already loaded, so both share one thread pool. Where no compiler
works (a slim image), `available()` is False and `ops.select` keeps the reference; the reason is
logged once.

Float32 tensors with a unit stride in their last dimension take the C path; anything else, and
the attention rows of prefill sequences, take the reference's. Results differ from the reference
by summation order only (about 1e-7 relative); the rotation is bit-identical.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvpilot.kernels import reference
from kvpilot.kernels.reference import ReferenceOps
from kvpilot.kernels.step_plan import StepPlan

__all__ = ["CpuOps", "available"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_P, _I, _F, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
_SIGNATURES = {
    "kvp_decode_attention": [_P] * 8 + [_I] * 5 + [_F] + [_L] * 11,
    "kvp_rms_norm": [_P] * 3 + [_I, _I, _F, _L, _L],
    "kvp_fused_add_rms_norm": [_P] * 3 + [_I, _I, _F, _L, _L],
    "kvp_rotary": [_P] * 4 + [_I] * 4 + [_L] * 5,
    "kvp_write_kv_cache": [_P] * 5 + [_I] * 4 + [_L] * 10,
}


def _build_dir() -> Path:
    root = Path(os.environ.get("KVPILOT_CACHE", Path.home() / ".cache" / "kvpilot"))
    return root / "cpu-kernels"


def _compile(source: Path, target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename, so concurrent first uses never load a half-written file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run([compiler, *CFLAGS, str(source), "-o", str(built), "-lmvec", "-lm"],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise OSError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(built, target)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


@functools.cache
def _library() -> ctypes.CDLL | None:
    # -march=native: the build is only good for this kind of processor, so its flags are in the key
    host = platform.machine() + _cpu_flags()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + host.encode()).hexdigest()[:16]
    target = _build_dir() / f"kvp_cpu_kernels-{digest}.so"
    try:
        if not target.exists():
            _compile(SOURCE, target)
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        log.warning("CPU kernels unavailable, using the torch reference: %s", exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
    lib.kvp_decode_attention.restype = ctypes.c_int
    return lib


def available() -> bool:
    """True when the C kernels are built (or build now) and load."""
    return _library() is not None


def _fp32_rows(*tensors: torch.Tensor) -> bool:
    """float32 CPU tensors with a unit stride in their last dimension (the C kernels' layout)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)


def _same(what: str, a: object, b: object) -> None:
    """The C kernels trust their sizes: a mismatch would read out of bounds, so it raises here."""
    if a != b:
        raise ValueError(f"{what}: {a} != {b}")


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built; ops.select routes to the reference instead")
    return lib


class CpuOps(ReferenceOps):
    """The C kernels where the tensors fit them (float32, unit stride in the last dim), the
    reference's ops otherwise."""

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan,
                        scale: float, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """The decode rows in C; the rows of sequences with several new tokens as the reference
        (FP8 caches: all rows as the reference)."""
        block_tables, seq_lens = plan.block_tables, plan.seq_lens
        if not (_fp32_rows(q, k_cache, v_cache) and block_tables.dtype == seq_lens.dtype == torch.int32
                and block_tables.stride(-1) == 1 and seq_lens.is_contiguous()):
            return super().paged_attention(q, k_cache, v_cache, plan, scale, kv_scales)
        _same("k_cache/v_cache shapes", k_cache.shape, v_cache.shape)
        _same("q head_dim vs cache head_dim", q.shape[2], k_cache.shape[3])
        _same("seq_lens vs block_tables rows", seq_lens.shape[0], block_tables.shape[0])
        rows = plan.decode_rows
        out = torch.empty_like(q)
        if not rows.all_decode:
            plan.check_block_size(k_cache)
            reference.prefill_attention_into(out, q, k_cache, v_cache, plan.attention.prefill, scale)
        if rows.seq_ids.numel():
            failed = _lib().kvp_decode_attention(
                out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                seq_lens.data_ptr(), rows.seq_ids.data_ptr(), rows.q_rows.data_ptr(),
                rows.seq_ids.numel(), q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
                block_tables.stride(0))
            if failed:
                raise MemoryError("CPU decode attention could not allocate its score buffer")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or not (_fp32_rows(x) and weight.dtype == torch.float32 and weight.is_contiguous()):
            return reference.rms_norm(x, weight, eps)
        _same("weight size vs hidden size", weight.numel(), x.shape[1])
        out = torch.empty(x.shape, dtype=x.dtype)
        _lib().kvp_rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps,
                            out.stride(0), x.stride(0))
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        if x.dim() != 2 or not (_fp32_rows(x, residual) and weight.dtype == torch.float32
                                and weight.is_contiguous()):
            reference.fused_add_rms_norm(x, residual, weight, eps)
            return
        _same("residual shape vs x shape", residual.shape, x.shape)
        _same("weight size vs hidden size", weight.numel(), x.shape[1])
        _lib().kvp_fused_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0],
                                      x.shape[1], eps, x.stride(0), residual.stride(0))

    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, plan: StepPlan) -> None:
        """Bit-identical to the reference's."""
        positions, cos_sin_cache = plan.positions, plan.cos_sin_cache
        if not (_fp32_rows(q, k, cos_sin_cache) and positions.dtype == torch.int64 and positions.is_contiguous()):
            super().rotary_embedding(q, k, plan)
            return
        _same("positions vs q tokens", positions.numel(), q.shape[0])
        _same("k tokens vs q tokens", k.shape[0], q.shape[0])
        _same("k head_dim vs q head_dim", k.shape[2], q.shape[2])
        _same("cos_sin_cache width vs head_dim", cos_sin_cache.shape[1], q.shape[2])
        _lib().kvp_rotary(positions.data_ptr(), q.data_ptr(), k.data_ptr(), cos_sin_cache.data_ptr(), q.shape[0],
                          q.shape[1], k.shape[1], q.shape[2], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                          cos_sin_cache.stride(0))

    def write_kv_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       plan: StepPlan, kv_scales: torch.Tensor | None = None) -> None:
        slot_mapping = plan.slot_mapping
        if not (_fp32_rows(k, v, k_cache, v_cache) and slot_mapping.dtype == torch.int64
                and slot_mapping.is_contiguous()):
            super().write_kv_cache(k, v, k_cache, v_cache, plan, kv_scales)
            return
        _same("k/v shapes", k.shape, v.shape)
        _same("k_cache/v_cache shapes", k_cache.shape, v_cache.shape)
        _same("k (heads, head_dim) vs cache", k.shape[1:], k_cache.shape[2:])
        _same("slot_mapping vs k tokens", slot_mapping.numel(), k.shape[0])
        _lib().kvp_write_kv_cache(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                  slot_mapping.data_ptr(), k.shape[0], k.shape[1], k.shape[2], k_cache.shape[1],
                                  k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
                                  *v_cache.stride()[:3])
