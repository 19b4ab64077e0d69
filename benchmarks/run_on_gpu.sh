#!/usr/bin/env bash
# Everything the repository checks and times on a GPU (any CUDA machine with torch, triton,
# transformers and pytest):
#   COMMIT=<hash> bash benchmarks/run_on_gpu.sh [--sweep]
# (COMMIT is only the label written into the results: give it from your checkout, since a copy of
# the working tree may keep an older git HEAD, and `git rev-parse HEAD` there names the wrong commit.)
# GPU tests (kernels at real sizes, the engine on CUDA against HF; TESTS narrows them), then the
# kernel benchmark (extra arguments go to it), then whole-engine throughput with and without decode
# CUDA graphs. Logs and results land in $OUT; TEST_LIMIT, KERNEL_LIMIT and ENGINE_LIMIT cap each
# step's seconds (0 skips the step). The defaults add up to more than
# one 600 s device call: split a full run over calls, e.g. the tests in one and the rest in another.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
# Without an install, a folder of links gives the import names (kvpilot.runtime -> runtime/, ...).
shim=$(mktemp -d)
mkdir -p "$shim/kvpilot"
for c in runtime kernels operator bench; do ln -s "$PWD/$c" "$shim/kvpilot/$c"; done
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"  # wheels carried on PYTHONPATH stay importable
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
# run_step LIMIT_SECONDS ...: the command under a time cap; a cap of 0 skips the step
run_step() {
    local limit=$1
    shift
    [ "$limit" -gt 0 ] && timeout "$limit" "$@"
}
# shellcheck disable=SC2086 (TESTS is a list of paths)
run_step "${TEST_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/kernels tests/runtime/test_gpu_engine.py} \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25
run_step "${KERNEL_LIMIT:-300}" python3 benchmarks/bench_kernels.py --out "$OUT" --commit "${COMMIT:-unknown}" "$@" \
    > "$OUT/bench_kernels.log" 2>&1
sed -n '/^summary/,$p' "$OUT/bench_kernels.log" | tail -30; tail -3 "$OUT/bench_kernels.log"
# each batch size with and without decode CUDA graphs, in one engine
run_step "${ENGINE_LIMIT:-300}" python3 benchmarks/bench_engine_gpu.py --out "$OUT/bench_engine.json" 2>&1 \
    | tee "$OUT/bench_engine.log" | tail -10
