"""A diagnostic for the last gap of issue 5, outside Triton: how fast can any kernel stream the
decode benchmark's K/V bytes, paged (block 16, head-major, random tables) or contiguous (SDPA's
layout)? A hand-written CUDA kernel reads them with 16-byte non-coherent loads, UNROLL cache blocks
in flight per thread, and sums the words (checked against torch), with no attention math.

Not part of the engine (kvpilot's kernels are Triton); it needs nvcc and an sm_90 GPU, and talks
to the CUDA driver through ctypes, so no extension build and no ninja. SDPA and the shipped decode
kernel are timed in the same process.
    python benchmarks/exp_cuda_read.py [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpilot.kernels.paged_attention import DecodeConfig, paged_attention_with

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_kernels.py, see exp_decode_paging.py
from bench_kernels import Bench  # noqa: E402

# One thread block per (KV head, sequence). Run r of the (sequence, head) lies at
# (table[r] * run_stride + head * head_stride) * RUN_VEC 16-byte vectors; each thread loads its
# vectors of UNROLL runs before adding any, so UNROLL x RUN_VEC / blockDim loads are in flight.
SOURCE = r"""
#include <cuda_pipeline.h>
constexpr int THREADS = 128, RUN_VEC = 256;  // a run: 256 vectors of 16 B = one (block, head) at block 16

__device__ long run_at(const int* t, int r, int run_stride, int head_stride) {
    return ((long)t[r] * run_stride + (long)blockIdx.x * head_stride) * RUN_VEC;
}

// Registers: each thread loads its vectors of UNROLL runs (K and V) before adding any.
template <int UNROLL>
__device__ void read_registers(const uint4* __restrict__ k, const uint4* __restrict__ v,
                               const int* __restrict__ tables, int runs, int stride_bt,
                               int run_stride, int head_stride, unsigned* __restrict__ out) {
    extern __shared__ int table[];
    for (int r = threadIdx.x; r < runs; r += THREADS) table[r] = tables[(long)blockIdx.y * stride_bt + r];
    __syncthreads();
    unsigned acc = 0;
    for (int r0 = 0; r0 < runs; r0 += UNROLL) {
        uint4 kx[UNROLL][RUN_VEC / THREADS], vx[UNROLL][RUN_VEC / THREADS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            long base = run_at(table, r0 + u, run_stride, head_stride) + threadIdx.x;
#pragma unroll
            for (int i = 0; i < RUN_VEC / THREADS; ++i) {
                kx[u][i] = __ldg(k + base + i * THREADS);
                vx[u][i] = __ldg(v + base + i * THREADS);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int i = 0; i < RUN_VEC / THREADS; ++i)
                acc += kx[u][i].x + kx[u][i].y + kx[u][i].z + kx[u][i].w
                     + vx[u][i].x + vx[u][i].y + vx[u][i].z + vx[u][i].w;
    }
    out[((long)blockIdx.y * gridDim.x + blockIdx.x) * THREADS + threadIdx.x] = acc;
}

// cp.async into shared memory, STAGES groups of UNROLL runs (K and V) in flight; a thread sums
// only the vectors it copied, so no barrier is needed past the table.
template <int UNROLL, int STAGES>
__device__ void read_async(const uint4* __restrict__ k, const uint4* __restrict__ v,
                           const int* __restrict__ tables, int runs, int stride_bt,
                           int run_stride, int head_stride, unsigned* __restrict__ out) {
    extern __shared__ uint4 smem[];  // STAGES x UNROLL x 2 runs, then the table
    int* table = reinterpret_cast<int*>(smem + STAGES * UNROLL * 2 * RUN_VEC);
    for (int r = threadIdx.x; r < runs; r += THREADS) table[r] = tables[(long)blockIdx.y * stride_bt + r];
    __syncthreads();
    const int groups = runs / UNROLL;
    auto issue = [&](int g) {
        if (g < groups) {
            uint4* slot = smem + (g % STAGES) * UNROLL * 2 * RUN_VEC;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                long base = run_at(table, g * UNROLL + u, run_stride, head_stride) + threadIdx.x;
#pragma unroll
                for (int i = 0; i < RUN_VEC / THREADS; ++i) {
                    __pipeline_memcpy_async(slot + (2 * u) * RUN_VEC + i * THREADS + threadIdx.x,
                                            k + base + i * THREADS, 16);
                    __pipeline_memcpy_async(slot + (2 * u + 1) * RUN_VEC + i * THREADS + threadIdx.x,
                                            v + base + i * THREADS, 16);
                }
            }
        }
        __pipeline_commit();
    };
#pragma unroll
    for (int g = 0; g < STAGES - 1; ++g) issue(g);
    unsigned acc = 0;
    for (int g = 0; g < groups; ++g) {
        issue(g + STAGES - 1);
        __pipeline_wait_prior(STAGES - 1);
        const uint4* slot = smem + (g % STAGES) * UNROLL * 2 * RUN_VEC;
#pragma unroll
        for (int j = 0; j < UNROLL * 2 * RUN_VEC / THREADS; ++j) {
            uint4 x = slot[j * THREADS + threadIdx.x];
            acc += x.x + x.y + x.z + x.w;
        }
    }
    out[((long)blockIdx.y * gridDim.x + blockIdx.x) * THREADS + threadIdx.x] = acc;
}

#define ARGS const uint4* k, const uint4* v, const int* t, int runs, int sbt, int rs, int hs, unsigned* o
#define REG(U) extern "C" __global__ void __launch_bounds__(THREADS) reg_u##U(ARGS) { \
    read_registers<U>(k, v, t, runs, sbt, rs, hs, o); }
#define ASYNC(U, S) extern "C" __global__ void __launch_bounds__(THREADS) async_u##U##_s##S(ARGS) { \
    read_async<U, S>(k, v, t, runs, sbt, rs, hs, o); }
REG(2) REG(4) REG(8)
ASYNC(1, 4) ASYNC(1, 8) ASYNC(2, 3) ASYNC(2, 4) ASYNC(4, 2) ASYNC(4, 3)
"""
# kernel name -> dynamic shared memory bytes besides the table (16 KiB = K and V of 2 runs of 4 KiB)
TABLE_BYTES = 128 * 4  # the block table of one sequence (2048 tokens / 16), kept in shared memory
KERNELS = {"reg_u2": 0, "reg_u4": 0, "reg_u8": 0, **{f"async_u{u}_s{s}": u * s * 8192 for u, s in
                                                     ((1, 4), (1, 8), (2, 3), (2, 4), (4, 2), (4, 3))}}


class Driver:
    """The kernels above, compiled by nvcc for sm_90 and launched through the CUDA driver API on
    torch's current stream (torch has made its context current by then)."""

    def __init__(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            cu, cubin = Path(tmp, "read.cu"), Path(tmp, "read.cubin")
            cu.write_text(SOURCE)
            subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "-o", str(cubin), str(cu)], check=True)
            self.image = cubin.read_bytes()
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.module = ctypes.c_void_p()
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), self.image))
        self.functions = {}
        for name, smem in KERNELS.items():
            fn = ctypes.c_void_p()
            self._check(self.cuda.cuModuleGetFunction(ctypes.byref(fn), self.module, name.encode()))
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: above 48 KiB needs asking for
            self._check(self.cuda.cuFuncSetAttribute(fn, 8, smem + TABLE_BYTES))
            self.functions[name] = (fn, smem + TABLE_BYTES)

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"CUDA driver error {rc}")

    def read(self, name, k, v, tables, runs, run_stride, head_stride, heads, out):
        fn, smem = self.functions[name]
        args = [ctypes.c_void_p(k.data_ptr()), ctypes.c_void_p(v.data_ptr()), ctypes.c_void_p(tables.data_ptr()),
                ctypes.c_int(runs), ctypes.c_int(tables.stride(0)), ctypes.c_int(run_stride),
                ctypes.c_int(head_stride), ctypes.c_void_p(out.data_ptr())]
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.cuda.cuLaunchKernel(fn, heads, tables.shape[0], 1, 128, 1, 1, smem, stream, params, None))
        return out


def word_sums(x: torch.Tensor) -> torch.Tensor:
    """Per leading index: the sum of x's 32-bit words modulo 2**32 (what the kernel adds up)."""
    return x.contiguous().view(torch.int32).flatten(1).long().sum(1) % 2**32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    bench = Bench(args.out, "exp", sweep=False)
    b, ctx, heads, kvh, d, bs = 64, 2048, 32, 8, 128, 16
    kv_bytes = 2 * b * ctx * kvh * d * 2
    rows: list[dict] = []

    def record(name: str, ms: float) -> None:
        rows.append({"name": name, "ms": ms, "TBps": kv_bytes / ms / 1e9})
        print(f"{name:60s} {ms:.4f} ms {kv_bytes / ms / 1e9:.3f} TB/s", flush=True)

    batch = bench.paged_batch([(ctx, 1)] * b, heads, kvh, d, bs)
    q, k_cache, v_cache, tables, seq_lens, qsl = batch
    kc, vc = bench.contiguous_kv(batch, ctx)  # (b, kvh, ctx, d)
    drv = Driver()  # after torch has made its CUDA context current
    runs = ctx // bs
    out = torch.empty(b, kvh, 128, dtype=torch.int32, device=q.device)
    # the paged caches are head-major: run (block, head) at (block * kvh + head) x 4 KiB
    want = (word_sums(k_cache.transpose(1, 2).flatten(0, 1)) + word_sums(v_cache.transpose(1, 2).flatten(0, 1)))
    want = want.view(-1, kvh)[tables.long()].sum(1) % 2**32  # (b, kvh)
    # contiguous: sequence s's run r of head h at ((s * kvh + h) * runs + r) x 4 KiB
    contiguous_tables = (torch.arange(b, device=q.device)[:, None] * kvh * runs
                         + torch.arange(runs, device=q.device)[None, :]).int()
    want_contiguous = (word_sums(kc.flatten(0, 1)) + word_sums(vc.flatten(0, 1))).view(b, kvh) % 2**32
    sequential = torch.arange(tables.numel(), dtype=torch.int32, device=q.device).view_as(tables)
    layouts = {"paged random tables": (k_cache, v_cache, tables, kvh, 1, want),
               "paged sequential tables": (k_cache, v_cache, sequential, kvh, 1, None),
               "contiguous (SDPA's layout)": (kc, vc, contiguous_tables, 1, runs, want_contiguous)}
    qb = q.view(b, heads, 1, d)
    scale = d ** -0.5
    for rep in range(2):
        record(f"peer: SDPA on contiguous KV (#{rep})",
               bench.time_ms(partial(F.scaled_dot_product_attention, qb, kc, vc, scale=scale, enable_gqa=True)))
        record(f"shipped decode kernel, block 16 (#{rep})",
               bench.time_ms(partial(paged_attention_with, q, k_cache, v_cache, tables, seq_lens, qsl, scale,
                                     max_query_len=1, decode=DecodeConfig())))
        for kernel in KERNELS:
            for layout, (k, v, t, run_stride, head_stride, expect) in layouts.items():
                run = partial(drv.read, kernel, k, v, t, runs, run_stride, head_stride, kvh, out)
                if rep == 0 and expect is not None:
                    got = run().view(torch.int32).long().sum(2) % 2**32
                    if not torch.equal(got, expect):
                        print(f"CUDA {kernel} {layout}: WRONG sums", flush=True)
                        continue
                record(f"CUDA {kernel} {layout} (#{rep})", bench.time_ms(run))
    (args.out / "exp_cuda_read.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
