#!/bin/bash
# One benchmark script on two commits' trees, alternating, so that both see the same machine:
#
#   benchmarks/before_after.sh BEFORE AFTER ROUNDS SCRIPT [ARGS...]
#
# e.g. OMP_NUM_THREADS=1 benchmarks/before_after.sh 18ec44d main 3 benchmarks/bench_cpu.py --repeats 3 --skip-hf --steps
#
# Each commit is exported (git archive) into a temporary folder with a `kvpilot` folder of links to
# its packages, put first on PYTHONPATH for its runs (as benchmarks/run_on_gpu.sh does), with
# KVPILOT_BENCH_COMMIT naming it (the runs are outside any git checkout); SCRIPT is
# this checkout's copy, the same for both, run with the Python of .venv (or $PYTHON). A module that
# one tree lacks is still found in the installed checkout: time what both trees have.
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n 2,10p "$0" >&2
  exit 2
fi
before=$1 after=$2 rounds=$3 script=$(realpath "$4")
shift 4
python=${PYTHON:-$PWD/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for side in before after; do
  commit=$(git rev-parse --short "${!side}")
  mkdir -p "$work/$side/tree" "$work/$side/shim/kvpilot"
  git archive "$commit" | tar -x -C "$work/$side/tree"
  for package in runtime kernels operator bench; do
    ln -s "$work/$side/tree/$package" "$work/$side/shim/kvpilot/$package"
  done
  echo "$commit" > "$work/$side/commit"
done
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    echo "=== $side $(cat "$work/$side/commit"), round $round, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M:%S)"
    (cd "$work" && PYTHONSAFEPATH=1 PYTHONPATH="$work/$side/shim" KVPILOT_BENCH_COMMIT="$(cat "$work/$side/commit")" \
      "$python" "$script" "$@")
  done
done
