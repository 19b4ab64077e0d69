"""Tensor parallelism on the CPU (gloo): TP=2 gives greedy output identical to TP=1 (and the
same prompt logprobs: the followers take part in the logits' collectives for them too), and each
rank reads only its slices of the checkpoint."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.executor.checkpoint_files import checkpoint_files
from kvpilot.runtime.executor.loader import load_model
from kvpilot.runtime.executor.parallel import TPInfo
from kvpilot.runtime.executor.weight_reader import safetensors_weights


def prompts(seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(n)]} for n in (5, 37, 90, 14)]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tp2_greedy_equals_tp1(kind: str, tiny_models) -> None:
    folder, _ = tiny_models[kind]
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=2)
    reference = LLM(folder, max_model_len=256).generate(prompts(1), params)
    single = [o.outputs[0].token_ids for o in reference]
    llm = LLM(folder, max_model_len=256, tensor_parallel_size=2)
    try:
        outs = llm.generate(prompts(1), params)
        sharded = [o.outputs[0].token_ids for o in outs]
        for ref, out in zip(reference, outs, strict=True):
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ref.prompt_logprobs)
            for a, b in zip(ref.prompt_logprobs[1:], out.prompt_logprobs[1:], strict=True):
                assert a.keys() == b.keys()
                assert all(b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4) for t in a)
        # after a live block-size change, which every rank applies
        llm.engine.update_config({"block_size": 8})
        again = [o.outputs[0].token_ids for o in llm.generate(prompts(1), params)]
    finally:
        llm.shutdown()
    assert sharded == single
    assert again == single


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tp2_under_preemption_equals_tp1(mode: str, tiny_models) -> None:
    folder, _ = tiny_models["llama"]
    params = SamplingParams(temperature=0, max_tokens=40)
    kw = dict(max_model_len=256, num_gpu_blocks_override=16, block_size=16, preemption_mode=mode, swap_space=0.01)
    single = [o.outputs[0].token_ids for o in LLM(folder, **kw).generate(prompts(2), params)]
    llm = LLM(folder, tensor_parallel_size=2, **kw)
    try:
        sharded = [o.outputs[0].token_ids for o in llm.generate(prompts(2), params)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert (llm.engine.scheduler.num_swapped_out > 0) == (mode == "swap")
    finally:
        llm.shutdown()
    assert sharded == single


def test_each_rank_reads_only_its_slices(tiny_models) -> None:
    folder, hf = tiny_models["qwen2"]
    config = ModelConfig(model=folder, served_model_name="t", load_format="safetensors")
    full, _ = load_model(config, "cpu")
    total = sum(p.numel() * p.element_size() for p in hf.state_dict().values())
    shards = []
    for rank in range(2):
        model, _ = load_model(config, "cpu", TPInfo(rank, 2))
        sources = list(safetensors_weights(checkpoint_files(Path(folder))))
        model.load_weights(sources)  # again, counting the bytes this rank reads
        read = sum(s.bytes_read for _, s in sources)
        norms = sum(p.numel() * p.element_size() for n, p in hf.state_dict().items() if "norm" in n)
        assert read <= total / 2 + norms  # replicated norms are the only repeated bytes
        shards.append(model)
    # the two halves put back together are the unsharded model
    q0, q1 = (m.layers[0].o_proj.weight for m in shards)
    assert torch.equal(torch.cat([q0, q1], dim=1), full.layers[0].o_proj.weight)
    e0, e1 = (m.embed_tokens.weight for m in shards)
    assert torch.equal(torch.cat([e0, e1])[:256], full.embed_tokens.weight)


def test_tp_size_must_divide_the_head_counts(tiny_models) -> None:
    folder, _ = tiny_models["llama"]  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide the model's KV heads"):
        LLM(folder, tensor_parallel_size=4)
