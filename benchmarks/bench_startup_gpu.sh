#!/usr/bin/env bash
# `kvpilot serve` from process start to /ready on a CUDA machine, Llama-3-8B shape (16 GB of random
# bf16 weights, written once to local disk), phase by phase:
#   OUT=DIR bash benchmarks/bench_startup_gpu.sh
# 1. a fresh node: Triton's cache empty, so the start compiles every kernel it needs (one run);
# 2. Triton's cache filled by (1), as a second pod on the node with the chart's engineCache finds
#    it: page cache warm and cold (the checkpoint's pages evicted), each weight reader installed
#    (safetensors; fastsafetensors when importable), two runs each, with the work done after Ready.
# Runs from the tree without installing (a folder of links gives the import names, as in
# run_on_gpu.sh). `kvpilot serve` needs fastapi, uvicorn, pydantic, pyzmq and msgspec: put them on
# PYTHONPATH (e.g. their wheels unpacked) before running this. STARTUP_DIR (default
# /tmp/kvpilot-startup) holds the checkpoint and the caches; keep it on the local disk.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
shim=$(mktemp -d)
mkdir -p "$shim/kvpilot"
for c in runtime kernels operator bench; do ln -s "$PWD/$c" "$shim/kvpilot/$c"; done
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import fastapi, uvicorn, pydantic, zmq, msgspec" 2>"$OUT/startup_imports.log"; then
    echo "kvpilot serve cannot run here: $(tail -1 "$OUT/startup_imports.log") (put the server's wheels on PYTHONPATH)"
    exit 2
fi
work=${STARTUP_DIR:-/tmp/kvpilot-startup}
mkdir -p "$work"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
df -h "$work" | tail -1 | tee -a "$OUT/gpu.txt"
readers=(safetensors)
python3 -c "import fastsafetensors" 2>/dev/null && readers+=(fastsafetensors)
export KVPILOT_CACHE="$work/cache" TRITON_CACHE_DIR="$work/triton-$$"
common=(--write-checkpoint llama-3-8b --checkpoint-dir "$work/llama-3-8b"
        --serve-args "--max-num-seqs 256 --max-num-batched-tokens 8192")
timeout 240 python3 -m kvpilot.runtime.cli bench startup "${common[@]}" --runs 1 --cache warm \
    --readers safetensors --wait-after-ready 90 --output "$OUT/startup_fresh.json" 2>&1 | tee "$OUT/startup_fresh.log" | tail -25
timeout 330 python3 -m kvpilot.runtime.cli bench startup "${common[@]}" --runs 2 --cache warm cold \
    --readers "${readers[@]}" --wait-after-ready 60 --output "$OUT/startup.json" 2>&1 | tee "$OUT/startup.log" | tail -30
# where the engine core's imports go (the longest phase before the weights): the 15 slowest modules,
# cumulative microseconds, as the core imports them on this machine
python3 -X importtime -c "import kvpilot.runtime.engine.core, kvpilot.runtime.engine.engine, torch; torch.cuda.init()" \
    2> "$OUT/core_importtime.txt"
echo "core imports, slowest 15 (cumulative us):"
sort -t'|' -k2 -n -r "$OUT/core_importtime.txt" | head -15
rm -rf "$TRITON_CACHE_DIR" "$shim"
