"""No step compiles a paged-attention kernel mid-run: Triton compiles a kernel once per
specialisation key (constexprs, and integer arguments by "1" / "a multiple of 16" / other), so
the keys that steps of any number of sequences and any block-table width reach must all be
reached by the runner's start-up probes (a mixed step, then one one-token step per width that
`split_probe_widths` names). Launches are recorded instead of run, with the compiled (not
interpreted) kernels, in a process of its own: this suite's conftest turns on the interpreter,
which keeps no specialisation flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from kvpilot.kernels.paged_attention import launcher, pointer_decode, prefill, split_probe_widths

    BLOCK_SIZE, HEADS, KV_HEADS, DIM, MAX_BLOCKS = 64, 4, 1, 32, 72
    keys: dict[str, set] = {}
    calls: list = []

    def record(kernel):
        def run(*args, grid, warmup, **kwargs):
            values = list(args) + [kwargs[p.name] for p in kernel.params[len(args):]]
            key = tuple(("constexpr", v) if p.is_constexpr else
                        native_specialize_impl(BaseBackend, v, p.is_const, not p.do_not_specialize,
                                               not p.do_not_specialize_on_alignment)
                        for p, v in zip(kernel.params, values))
            key += (kwargs.get("num_warps"), kwargs.get("num_stages"))
            calls.append((kernel.fn.__name__, key))
        kernel.run = run

    for k in (pointer_decode._decode_kernel, pointer_decode._reduce_kernel, prefill._prefill_kernel):
        record(k)
    caches = [torch.zeros(4, BLOCK_SIZE, KV_HEADS, DIM, dtype=torch.float16) for _ in range(2)]

    def step(q_lens, width):
        n = len(q_lens)
        q = torch.zeros(sum(q_lens), HEADS, DIM, dtype=torch.float16)
        tables = torch.zeros(n, width, dtype=torch.int32)
        seq_lens = torch.tensor([max(q, 1) for q in q_lens], dtype=torch.int32)
        qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        launcher.paged_attention(q, *caches, tables, seq_lens, qsl, 0.1, max(q_lens))
        found = set(calls)
        calls.clear()
        return found

    reached = set()
    for n in range(1, 10):
        for width in range(1, MAX_BLOCKS + 1):
            reached |= step([1] * n, width)  # decode only
            reached |= step([2 * BLOCK_SIZE + 3] + [1] * (n - 1), width)  # a prefill beside decodes
    probes = step([2 * BLOCK_SIZE + 3, 1], 3)  # the runner's mixed probe
    for width in split_probe_widths(KV_HEADS, BLOCK_SIZE, MAX_BLOCKS, torch.device("cpu")):
        probes |= step([1], width)
    print(json.dumps({"reached": sorted(map(repr, reached)), "probes": sorted(map(repr, probes)),
                      "reduce_variants": len({k for name, k in reached if name == "_reduce_kernel"})}))
''')


def test_start_up_probes_reach_every_kernel_variant_that_steps_reach() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    reached, probes = set(result["reached"]), set(result["probes"])
    assert reached <= probes, sorted(reached - probes)
    # split-KV is reached (several reduce variants: one per power of two of slices), so the sweep is wide enough
    assert result["reduce_variants"] >= 2
    # decode with and without split, their reduce kernels, one prefill: widths and batch sizes add nothing else
    assert len(reached) == 3 + result["reduce_variants"]


def test_mid_run_compile_probe_runs_on_cpu(tmp_path) -> None:
    """benchmarks/compile_probe.py --mid-run's CPU path (a tiny model, no Triton kernels run, so no
    compilations): the stream of batches runs through every block size, switching with requests in flight."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "compile_probe.py")
    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, script, "--mid-run", "--preset", "tiny-llama", "--max-model-len", "256",
                    "--max-num-seqs", "8", "--batches", "1", "3", "8", "2", "--output", str(out)],
                   env=env, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["mid_run_compiles"] == 0 and result["steps"] > 0
    assert {s["to"] for s in result["switches"]} == set(result["block_sizes"])
    assert any(s["running_kept"] > 0 for s in result["switches"])
