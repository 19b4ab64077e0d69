"""Tensor-parallel workers fail fast (CPU, gloo): a worker that dies at start or mid-run makes
the engine raise the worker's error at once, the other workers are stopped, and no process is
left behind; an unguarded script gets the `if __name__ == "__main__":` fix instead of a hang."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.errors import EngineDeadError
from kvpilot.runtime.executor.worker import WorkerDiedError

PROMPTS = [{"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}, {"prompt_token_ids": [27, 18, 28]}]
SCRIPT = """
from kvpilot.runtime import LLM, SamplingParams

def main():
    llm = LLM({folder!r}, device="cpu", tensor_parallel_size=2, max_model_len=64)
    outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=8))
    print("TOKENS", [o.outputs[0].token_ids for o in outs])
    llm.shutdown()

{call}
"""


def run_script(tmp_path: Path, folder: str, guarded: bool) -> subprocess.CompletedProcess[str]:
    call = 'if __name__ == "__main__":\n    main()' if guarded else "main()"
    script = tmp_path / ("guarded.py" if guarded else "unguarded.py")
    script.write_text(SCRIPT.format(folder=folder, prompts=PROMPTS, call=call))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the bound is for the failure this guards against, a hang: a start takes seconds
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                           cwd=tmp_path, env=env)


def test_an_unguarded_script_fails_with_the_main_guard_hint(tiny_models, tmp_path: Path) -> None:
    folder, _ = tiny_models["llama"]
    done = run_script(tmp_path, folder, guarded=False)
    assert done.returncode != 0
    assert "TOKENS" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvpilot.runtime.executor.worker.WorkerDiedError: tensor-parallel worker 1 could not start")
    assert 'put that code under `if __name__ == "__main__":`' in last


def test_a_guarded_script_matches_one_device_token_for_token(tiny_models, tmp_path: Path) -> None:
    folder, _ = tiny_models["llama"]
    done = run_script(tmp_path, folder, guarded=True)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [ln for ln in done.stdout.splitlines() if ln.startswith("TOKENS ")]
    single = LLM(folder, device="cpu", max_model_len=64).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    assert json.loads(line.removeprefix("TOKENS ")) == [o.outputs[0].token_ids for o in single]


def test_a_worker_killed_mid_run_fails_the_engine_and_the_others_are_stopped(tiny_models) -> None:
    folder, _ = tiny_models["tied-mha"]  # 4 KV heads: four ranks
    llm = LLM(folder, device="cpu", tensor_parallel_size=4, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4)
    workers = llm.engine._workers
    assert workers is not None
    procs = list(workers.procs)
    try:
        assert len(llm.generate(PROMPTS, params)) == 2
        procs[1].kill()  # rank 2
        with pytest.raises(WorkerDiedError, match=r"tensor-parallel worker 2 \(pid \d+\) was killed by signal 9") as info:
            llm.generate(PROMPTS, params)
        assert isinstance(info.value, EngineDeadError)
        # the engine stays dead, without touching the group again
        with pytest.raises(WorkerDiedError):
            llm.engine.step()
        # ranks 1 and 3 were stopped by the engine, not left waiting on rank 2
        assert not any(p.is_alive() for p in procs)
        assert all(p.exitcode is not None for p in procs)
    finally:
        llm.shutdown()
    assert not set(mp.active_children()) & set(procs)


def test_a_worker_that_fails_while_loading_fails_the_engine_with_its_error(tiny_models, tmp_path: Path) -> None:
    """Rank 1 cannot read its weights (rank 0 can): rank 0 raises rank 1's error, not a hang."""
    folder, _ = tiny_models["llama"]
    script = tmp_path / "load_failure.py"
    script.write_text(LOAD_FAILURE.format(folder=folder))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CAUGHT WorkerDiedError tensor-parallel worker 1" in done.stdout
    assert "OSError: rank 1 cannot read its weights" in done.stdout
    assert "CHILDREN []" in done.stdout


# runs again in the worker (as its main module): there the patched loader fails on rank 1
LOAD_FAILURE = """
import multiprocessing as mp
from kvpilot.runtime import LLM
from kvpilot.runtime.executor import model_runner

real = model_runner.load_model
def load_model(config, device, tp, *rest):
    if tp.rank == 1:
        raise OSError("rank 1 cannot read its weights")
    return real(config, device, tp, *rest)
model_runner.load_model = load_model

if __name__ == "__main__":
    try:
        LLM({folder!r}, device="cpu", tensor_parallel_size=2, max_model_len=64)
    except Exception as e:
        print("CAUGHT", type(e).__name__, str(e).replace(chr(10), " "))
    print("CHILDREN", mp.active_children())
"""
