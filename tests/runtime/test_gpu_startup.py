"""Start-up on CUDA: only the start block size is prepared before the engine is ready; the swap
space's pinned memory and the other sizes' kernels and decode graphs come afterwards between steps
(engine/warm_up.py), the same tokens as HF come out meanwhile, and a later switch replays the graphs
instead of capturing anew; the fastsafetensors reader fills the same weights as the safetensors
one. Skipped without CUDA."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch
from tiny_models import hf_greedy, make_tiny_model

from kvpilot.runtime import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# a fixed cache: the profile's budget is a share of the card minus what this process holds, which an
# earlier test's engine not yet collected may have taken whole
BLOCKS = 256


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    folder = tmp_path_factory.mktemp("llama")
    return str(folder), make_tiny_model(Path(folder), "llama")


def test_other_block_sizes_are_prepared_between_steps_and_replayed_after_a_switch(llama) -> None:
    folder, hf = llama
    llm = LLM(folder, device="cuda", dtype="float32", max_model_len=256, block_size=16, max_num_seqs=8,
              num_gpu_blocks_override=BLOCKS)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.captured_block_sizes == [16] and engine.warm_up.pending
    assert runner.swap_space is not None and not runner.swap_space.host_allocated  # pinned after Ready
    phases = {p.name: p for p in engine.startup.phases}
    assert phases["graphs"].details == {"batch_sizes": 4, "block_sizes": [16]}  # 1, 2, 4 and 8 (max_num_seqs)
    assert phases["kernels"].details["block_sizes"] == [16] and phases["kernels"].details["kernels_compiled"] >= 0
    rng = random.Random(5)
    batch = [[rng.randrange(256) for _ in range(n)] for n in (5, 40, 120, 17)]
    params = SamplingParams(temperature=0, max_tokens=24)
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():  # a unit after every step, as a busy server's core runs them
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        engine.warm_up.run_one(idle=False)
    assert [done[str(i)] for i in range(len(batch))] == [hf_greedy(hf, p, 24) for p in batch]
    assert not runner.swap_space.host_allocated  # busy all along: it waits for an idle moment
    engine.warm_up.finish()
    assert runner.captured_block_sizes == runner.allowed_block_sizes
    assert runner.swap_space.host_allocated and runner.swap_space.host.is_pinned()
    prepared = {size: runner._graph_sets.get(size) for size in runner.allowed_block_sizes}
    for size in (8, 32):
        engine.update_config({"block_size": size})
        assert runner.graphs is prepared[size]  # no capture at the switch
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in batch]
        assert runner.graphs.replays > 0


def test_fastsafetensors_reader_fills_the_same_weights(llama, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastsafetensors")
    folder, _ = llama
    params = {}
    for reader in ("safetensors", "fastsafetensors"):
        monkeypatch.setenv("KVPILOT_WEIGHT_READER", reader)
        llm = LLM(folder, device="cuda", dtype="float32", max_model_len=256, enforce_eager=True,
                  num_gpu_blocks_override=BLOCKS)
        params[reader] = {n: p.detach().cpu() for n, p in llm.engine.runner.model.named_parameters()}
        llm.shutdown()
        del llm
        gc.collect()  # the engine holds reference cycles: free its memory before the next one sizes its cache
        torch.cuda.empty_cache()
    assert params["safetensors"].keys() == params["fastsafetensors"].keys()
    for name, tensor in params["safetensors"].items():
        assert torch.equal(tensor, params["fastsafetensors"][name]), name
