"""Compile the decode attention kernel for an H200 (sm_90) on any machine, no GPU needed, and report
what decides its speed before spending device time: registers, spills, shared memory, programs
resident per SM, waves for the B=64 x 2048 benchmark case (8 KV heads: 512 programs), and how many
shared-memory buffers Triton's pipeliner gave the K/V tiles (1: a program waits for each tile).

Usage: PYTHONSAFEPATH=1 python benchmarks/compile_probe.py [--configs 64,2,2 32,2,3,prefetch ...]
(needs the kvpilot import names: an install, or benchmarks/run_on_gpu.sh's shim folder)

The figures are the compiler's; the timings they explain, and what the probe showed, are in
benchmarks/RESULTS.md (Kernels, "Offline").
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from kvpilot.kernels.paged_attention import pointer_decode
from kvpilot.kernels.paged_attention.pointer_decode import DecodeConfig

SM90 = GPUTarget("cuda", 90, 32)
SMS, SMEM_PER_SM, REGS_PER_SM, PROGRAMS = 132, 228 * 1024, 65536, 64 * 8
POINTERS = {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "q_ptr": "*bf16",
            "k_ptr": "*bf16", "v_ptr": "*bf16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
            "qsl_ptr": "*i32"}


def compile_decode(cfg: DecodeConfig, multi: bool = False, block_size: int = 16) -> object:
    """The decode kernel as the benchmark launches it: bf16, 32/8 heads, head dim 128, no split;
    pointers and integer arguments marked 16-divisible as Triton's launcher would find them."""
    kernel = pointer_decode._decode_kernel
    consts = dict(GROUP=4, M=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n,
                  SPLIT=False, MULTI=multi, PRECISION="tf32", PREFETCH=cfg.prefetch)
    signature: dict[str, str] = {}
    attrs = {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        signature[name] = POINTERS.get(name, "fp32" if name == "scale_log2" else "i32")
        if name != "scale_log2":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    options = triton.compiler.make_backend(SM90).parse_options({"num_warps": cfg.num_warps,
                                                                 "num_stages": cfg.num_stages})
    return triton.compile(src, target=SM90, options=options.__dict__)


def resources(compiled: object) -> dict[str, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])  # type: ignore[attr-defined]
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert found, usage
    return {"regs": int(found.group(1)), "stack": int(found.group(2)), "local": int(found.group(3))}


def parse_config(text: str) -> DecodeConfig:
    parts = text.split(",")
    return DecodeConfig(int(parts[0]), int(parts[1]), int(parts[2]), prefetch="prefetch" in parts[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["64,2,2", "64,4,2", "128,4,2", "32,2,3,prefetch",
                                                         "32,4,3,prefetch", "64,2,3,prefetch"],
                        help="block_n,num_warps,num_stages[,prefetch] of the single-token kernel")
    parser.add_argument("--multi", action="store_true", help="the MULTI kernel instead")
    args = parser.parse_args()
    for text in args.configs:
        cfg = parse_config(text)
        compiled = compile_decode(cfg, args.multi)
        res = resources(compiled)
        smem = compiled.metadata.shared  # type: ignore[attr-defined]
        buffers = sorted({int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x128xbf16",
                                                     compiled.asm["ttgir"])})  # type: ignore[attr-defined]
        per_warp = -(-res["regs"] * 32 // 256) * 256  # registers are allocated per warp in 256s
        resident = min(REGS_PER_SM // (per_warp * cfg.num_warps), SMEM_PER_SM // (smem + 1024),
                       64 // cfg.num_warps, 32)
        print(f"{text:18s} regs {res['regs']:3d} spill {res['local']:3d} B  smem {smem / 1024:5.1f} KiB  "
              f"K/V buffers {buffers}  programs/SM {resident}  waves {PROGRAMS / (SMS * resident):.2f}")


if __name__ == "__main__":
    main()
