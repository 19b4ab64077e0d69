"""Two probes of Triton compilation.

Resources (the default): compile the decode attention kernel for an H200 (sm_90) on any machine,
no GPU needed, and report what decides its speed before spending device time: registers, spills,
shared memory, programs resident per SM, waves for the B=64 x 2048 benchmark case (8 KV heads: 512
programs), and how many shared-memory buffers Triton's pipeliner gave the K/V tiles (1: a program
waits for each tile).

  PYTHONSAFEPATH=1 python benchmarks/compile_probe.py [--configs 64,2,2 32,2,3,prefetch ...]

Mid-run (`--mid-run`, a GPU): start an engine (a dummy-weight preset, by default the Llama-3-8B
shape in bf16 with the full cache; start-up compiles every kernel variant and captures the decode
graphs of every block size), then count the Triton kernels compiled after start-up (Triton's
post-compile hook: every specialisation first seen in the process, cached on disk or not) while
it serves a stream of varied batches: 1 to --max-num-seqs requests at a time, prompts whose block
tables are 1, 16, 17, 32 ... blocks wide and random ones, chunked prefills, eager and graph
decodes, and live block-size changes through every allowed size, under load. The expected count
is zero; each compile is listed with its kernel and specialisation.

  PYTHONSAFEPATH=1 python benchmarks/compile_probe.py --mid-run --output compile_probe.json

(both need the kvpilot import names: an install, or benchmarks/run_on_gpu.sh's shim folder)

The figures are the compiler's; the timings they explain, and what the probe showed, are in
benchmarks/history/2026-12-03.md (Kernels, "Offline") and benchmarks/RESULTS.md ("Compilation
after start-up").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

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
    pointers and integer arguments marked 16-divisible as Triton's launcher would find them (but
    the arguments the kernel leaves unspecialised)."""
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
        if name != "scale_log2" and not kernel.params[i].do_not_specialize:
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


def mid_run(args: argparse.Namespace) -> dict[str, Any]:
    """Serve a stream of varied batches after start-up, counting Triton compilations."""
    from kvpilot.runtime import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(args.preset, load_format="dummy", block_size=args.block_size, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_chunked_prefill=True, enforce_eager=args.enforce_eager)
    engine = llm.engine
    start_s = time.perf_counter() - started
    compiles: list[dict[str, Any]] = []
    phase = {"name": "start"}

    def on_compile(*, key: Any, repr: str, fn: Any, **_: Any) -> None:
        compiles.append({"kernel": fn.name, "phase": phase["name"], "specialization": repr,
                         "at_s": round(time.perf_counter() - started, 3)})

    triton.knobs.runtime.jit_post_compile_hook = on_compile
    rng = random.Random(0)
    vocab = engine.runner.model_config.vocab_size
    sizes = engine.runner.allowed_block_sizes
    steps = 0
    switches: list[dict[str, Any]] = []

    def switch(size: int) -> None:
        old = engine.block_manager.block_size
        engine.update_config({"block_size": size})
        report = engine.last_relayout
        switches.append({"from": old, "to": size, "pause_ms": report.pause_ms if report else None,
                         "running_kept": report.num_running_kept if report else 0})

    for round_, n in enumerate(args.batches):
        size = sizes[round_ % len(sizes)]
        phase["name"] = f"{n} requests, block size {engine.block_manager.block_size} -> {size}"
        widths = [1, 16, 17, 32, 33, 48, rng.randrange(1, 64)]  # tables of these many blocks (of the size now)
        for i in range(n):
            bs = engine.block_manager.block_size
            length = min(args.max_model_len - 64, max(1, widths[i % len(widths)] * bs - rng.randrange(2)))
            if i % 3 == 2:
                length = rng.randrange(1, args.max_model_len - 64)
            engine.add_request(f"r{round_}-{i}", [rng.randrange(vocab) for _ in range(length)],
                               SamplingParams(temperature=0, max_tokens=rng.randrange(1, 48), ignore_eos=True))
        switched = False
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if not switched and steps % 7 == 0 and size != engine.block_manager.block_size:
                switch(size)  # mid-round: sequences in flight are re-laid
                switched = True
        if not switched and size != engine.block_manager.block_size:
            switch(size)
    triton.knobs.runtime.jit_post_compile_hook = None
    return {"preset": args.preset, "start_s": start_s, "steps": steps, "batches": args.batches,
            "block_sizes": sizes, "switches": switches, "enforce_eager": args.enforce_eager, "mid_run_compiles": len(compiles),
            "compiles": compiles}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["64,2,2", "64,4,2", "128,4,2", "32,2,3,prefetch",
                                                         "32,4,3,prefetch", "64,2,3,prefetch"],
                        help="block_n,num_warps,num_stages[,prefetch] of the single-token kernel")
    parser.add_argument("--multi", action="store_true", help="the MULTI kernel instead")
    parser.add_argument("--mid-run", action="store_true", help="count compilations after an engine's start-up (GPU)")
    parser.add_argument("--preset", default="llama-3-8b", help="--mid-run: a dummy-weight preset")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 7, 16, 17, 31, 64, 100, 256, 1, 33],
                        help="--mid-run: requests submitted together, one round each (a block size per round)")
    parser.add_argument("--enforce-eager", action="store_true", help="--mid-run: no decode graphs")
    parser.add_argument("--output", type=Path, help="--mid-run: write the results here as JSON")
    args = parser.parse_args()
    if args.mid_run:
        result = mid_run(args)
        print(f"{args.preset}: start-up {result['start_s']:.1f} s, then {result['steps']} steps over block sizes "
              f"{result['block_sizes']}: {result['mid_run_compiles']} Triton compilations after start-up")
        for c in result["compiles"]:
            print(f"  {c['at_s']:8.1f} s  {c['phase']}: {c['specialization']}")
        if args.output:
            args.output.write_text(json.dumps(result, indent=2))
        return
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
