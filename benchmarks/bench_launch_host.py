"""Host time of kvpilot's own launcher code, per call, with the Triton kernels stubbed out: what
each op costs the host before Triton's launcher takes over (eager steps pay it per op, layer and
step; graph replays do not). CPU tensors at the decode-benchmark shapes; no GPU needed.

Usage: PYTHONSAFEPATH=1 python benchmarks/bench_launch_host.py  (with kvpilot importable)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvpilot.kernels import cache, norm, rotary
from kvpilot.kernels.paged_attention import launcher, pointer_decode, prefill, tma_decode
from kvpilot.kernels.reference import kv_cache_empty
from kvpilot.kernels.step_plan import StepPlan
from kvpilot.kernels.triton_ops import TritonOps


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def per_call_us(fn: Callable[[], object], n: int = 2000, repeats: int = 7) -> float:
    """Best of `repeats` runs of n calls (the host's noise only ever adds time)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / n * 1e6


def main() -> None:
    for module, name in ((pointer_decode, "_decode_kernel"), (tma_decode, "_decode_tma_kernel"),
                         (prefill, "_prefill_kernel"), (pointer_decode, "_reduce_kernel"),
                         (cache, "_write_kv_cache_kernel"), (norm, "_rms_norm_kernel"), (rotary, "_rotary_kernel")):
        setattr(module, name, _NoLaunch())
    b, ctx, heads, kv_heads, d, block_size = 64, 2048, 32, 8, 128, 16
    num_blocks = b * ctx // block_size
    k_cache, v_cache = (kv_cache_empty(num_blocks, block_size, kv_heads, d, head_major=True,
                                       dtype=torch.float32, device=torch.device("cpu")) for _ in range(2))
    tables = torch.arange(num_blocks, dtype=torch.int32).view(b, -1)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    q, k, v = torch.randn(b, heads, d), torch.randn(b, kv_heads, d), torch.randn(b, kv_heads, d)
    slots, positions = torch.arange(b), torch.arange(b)
    x, res, w = torch.randn(b, 4096), torch.randn(b, 4096), torch.ones(4096)
    rope = torch.randn(ctx, d)
    plan = StepPlan(positions, slots, tables, seq_lens, qsl, 1, rope, block_size)
    triton_ops = TritonOps()
    ops = {
        "paged_attention (decode batch)": lambda: launcher.paged_attention(q, k_cache, v_cache, tables, seq_lens,
                                                                            qsl, 0.1, 1),
        "  the same through TritonOps": lambda: triton_ops.paged_attention(q, k_cache, v_cache, plan, 0.1),
        "write_kv_cache": lambda: cache.write_kv_cache(k, v, k_cache, v_cache, slots),
        "rotary_embedding": lambda: rotary.rotary_embedding(positions, q, k, rope),
        "fused_add_rms_norm": lambda: norm.fused_add_rms_norm(x, res, w, 1e-5),
    }
    for name, fn in ops.items():
        print(f"{name:32s} {per_call_us(fn):6.1f} µs")


if __name__ == "__main__":
    main()
