"""Prompt logprobs (`SamplingParams.prompt_logprobs`, what `echo` with `logprobs` serves): every
prompt token's logprob, rank and top alternatives under the model, checked against HF's
log-softmax of the same prompt, through the paths that could compute a position twice or not at
all: chunked prefill, a prefix the cache already holds, recompute preemption, several samples,
async scheduling, and several requests in one step. In float32 wherever they run: on a GPU the
default dtype is bf16, and there these prompts' logprobs came out 0.01-0.13 off HF's float32 ones."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.runtime import LLM, SamplingParams


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """(len(prompt) - 1, vocab): row i is the distribution prompt token i + 1 was drawn from."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


def assert_matches_hf(entries, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for i, entry in enumerate(entries[1:]):
        token, row = prompt[i + 1], ref[i]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {token, *top}
        for r, tid in enumerate(top, start=1):
            if tid != token:
                assert entry[tid].rank == r and entry[tid].logprob == pytest.approx(row[tid].item(), abs=1e-4)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_match_hf_whole_and_in_chunks(chunk: int | None, tiny_models) -> None:
    folder, hf = tiny_models["llama"]
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 2, 19, 40)]
    llm = LLM(folder, dtype="float32", max_model_len=128, block_size=8, enable_chunked_prefill=chunk is not None,
              max_num_batched_tokens=chunk or 256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 3)
        assert out.outputs[0].logprobs is None  # only asked for the prompt's
    plain = llm.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(tiny_models) -> None:
    """The prefix cache holds the prompt's leading blocks, but their positions have no logits
    there: a request asking for prompt logprobs computes them; one that does not reuses them."""
    folder, hf = tiny_models["qwen2"]
    rng = random.Random(2)
    prompt = [rng.randrange(256) for _ in range(37)]
    llm = LLM(folder, dtype="float32", max_model_len=128, block_size=8, enable_prefix_caching=True)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate([{"prompt_token_ids": prompt}], greedy)[0]
    scored = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0
    assert_matches_hf(scored.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 0)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids
    again = llm.generate([{"prompt_token_ids": prompt}], greedy)[0]
    assert again.num_cached_tokens == 32
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_logprobs_once_across_recompute_preemption_and_samples(tiny_models) -> None:
    """A cache too small for every sequence at once: sequences are preempted and prefilled again,
    yet each prompt position is scored once; with n=2 the request carries one set of entries."""
    folder, hf = tiny_models["mistral"]
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (30, 26, 33)]
    llm = LLM(folder, dtype="float32", max_model_len=96, block_size=8, num_gpu_blocks_override=12, preemption_mode="recompute")
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 2)
        assert [len(c.token_ids) for c in out.outputs] == [40, 40]


def test_prompt_logprobs_under_async_scheduling(tiny_models) -> None:
    folder, hf = tiny_models["llama"]
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (12, 29)]
    llm = LLM(folder, dtype="float32", max_model_len=128, block_size=8, async_scheduling=True, enable_chunked_prefill=True,
              max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1, logprobs=1))
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 1)
        assert len(out.outputs[0].logprobs) == 5


def test_prompt_logprobs_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs: must be between 0 and 20"):
        SamplingParams(prompt_logprobs=21)
