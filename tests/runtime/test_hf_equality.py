"""Greedy output equals Hugging Face transformers' `generate` token for token, on the embedded
SmolLM2 and on tiny random Llama, llama3-rope-scaled, Mistral, Qwen2 and tied-embedding models."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import TINY_CONFIGS, hf_greedy

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.tunables import BLOCK_SIZES

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in detail how a transformer language model turns a prompt into text, step by step, "
    "covering tokenization, embeddings, attention layers, the feed-forward blocks, the final "
    "projection onto the vocabulary and how sampling picks each next token. " * 3,
]


def chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return llm.tokenizer.encode(text)


def test_smollm2_chat_answer_matches_hf(smol_llm: LLM, smol_hf) -> None:
    out = smol_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
    ids = chat_ids(smol_llm, "What is the capital of France?")
    assert out.token_ids == hf_greedy(smol_hf, ids, 40, stop_at_eos=True)


def test_smollm2_batch_of_very_different_lengths_matches_hf(smol_llm: LLM, smol_hf) -> None:
    prompts = [smol_llm.tokenizer.encode("The capital of France is")] + [chat_ids(smol_llm, q) for q in QUESTIONS]
    assert max(map(len, prompts)) > 5 * min(map(len, prompts))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = smol_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(smol_hf, prompt, 24)


def test_smollm2_with_small_prefill_chunks_matches_hf(smol_folder: str, smol_hf) -> None:
    llm = LLM(max_model_len=512, max_num_batched_tokens=16, enable_chunked_prefill=True, block_size=8)
    prompts = [chat_ids(llm, q) for q in QUESTIONS[:3]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(smol_hf, prompt, 12)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def random_prompts(rng: random.Random, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_tiny_architecture_matches_hf(kind: str, tiny_models) -> None:
    folder, hf = tiny_models[kind]
    prompts = random_prompts(random.Random(kind), [1, 7, 33, 120])
    llm = LLM(folder, max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=20))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 20)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("chunk", [None, 16])
def test_every_block_size_and_chunking_matches_hf(block_size: int, chunk: int | None, tiny_models) -> None:
    folder, hf = tiny_models["llama"]
    prompts = random_prompts(random.Random(block_size), [3, 64, 150, 9, 71])
    llm = LLM(folder, max_model_len=256, block_size=block_size,
              enable_chunked_prefill=chunk is not None, max_num_batched_tokens=chunk or 256, max_num_seqs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=30))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 30)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_under_a_tiny_cache_keeps_greedy_output(tiny_models) -> None:
    folder, hf = tiny_models["qwen2"]
    prompts = random_prompts(random.Random(7), [40, 50, 60, 45])
    # 20 blocks of 16 = 320 slots for four sequences that grow to ~110 tokens each
    llm = LLM(folder, max_model_len=256, num_gpu_blocks_override=20, block_size=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=60))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 60)
    assert llm.engine.block_manager.num_free_blocks == 20


def run_counting_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """Step the engine by hand: each prompt's output tokens, and how many tokens the steps computed."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, params)
    outputs: dict[str, list[int]] = {}
    computed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        computed += engine.last_step.num_batched_tokens if engine.last_step else 0
    return [outputs[f"c{i}"] for i in range(len(prompts))], computed


@pytest.mark.parametrize("block_size", [8, 16])
def test_swap_preemption_keeps_greedy_output_without_recomputing(block_size: int, tiny_models) -> None:
    """Swapped-out sequences come back from host memory and continue: same tokens as HF, and fewer
    tokens computed than under recompute (which prefills the preempted sequences again)."""
    folder, hf = tiny_models["qwen2"]
    prompts = random_prompts(random.Random(7), [40, 50, 60, 45])
    params = SamplingParams(temperature=0, max_tokens=60)
    counts = {}
    for mode in ("recompute", "swap"):
        llm = LLM(folder, max_model_len=256, num_gpu_blocks_override=320 // block_size, block_size=block_size,
                  preemption_mode=mode, swap_space=0.01)
        outs, counts[mode] = run_counting_tokens(llm, prompts, params)
        sched = llm.engine.scheduler
        assert sched.num_preemptions > 0
        assert sched.num_swapped_out == (sched.num_preemptions if mode == "swap" else 0)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out == hf_greedy(hf, prompt, 60)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        assert sched.swap_pool.num_free_blocks == sched.num_swap_blocks and not sched.swapped
    no_preemption = sum(len(p) + 60 - 1 for p in prompts)
    assert counts["swap"] == no_preemption < counts["recompute"]


BLOCK_BYTES = 2 * 3 * 2 * 16 * 4 * 16  # K and V x 3 layers x 2 KV heads x head dim 16 x fp32 x 16 tokens


def test_swap_falls_back_to_recompute_when_the_swap_space_is_full(tiny_models) -> None:
    folder, hf = tiny_models["qwen2"]
    prompts = random_prompts(random.Random(7), [40, 50, 60, 45])
    llm = LLM(folder, max_model_len=256, num_gpu_blocks_override=20, block_size=16, preemption_mode="swap",
              swap_space=2.5 * BLOCK_BYTES / (1 << 30))  # room for two blocks
    assert llm.engine.runner.bytes_per_block == BLOCK_BYTES and llm.engine.scheduler.num_swap_blocks == 2
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=60))
    sched = llm.engine.scheduler
    assert sched.num_preemptions > sched.num_swapped_out  # some sequences held more than two blocks
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 60)


def test_live_switch_to_swap_and_a_block_size_change_with_swapped_sequences(tiny_models) -> None:
    folder, hf = tiny_models["llama"]
    prompts = random_prompts(random.Random(3), [40, 50, 60, 45])
    params = SamplingParams(temperature=0, max_tokens=50)
    llm = LLM(folder, max_model_len=256, num_gpu_blocks_override=20, block_size=16, swap_space=0.01)
    engine = llm.engine
    engine.update_config({"preemption_mode": "swap"})
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    outputs: dict[str, list[int]] = {}
    resized = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        if engine.scheduler.swapped and not resized:  # re-cut the cache while sequences sit in host memory
            engine.update_config({"block_size": 8})
            resized = True
    assert resized and engine.scheduler.num_swapped_out > 0
    for i, p in enumerate(prompts):
        assert outputs[f"s{i}"] == hf_greedy(hf, p, 50)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_agree_with_hf_log_softmax(smol_llm: LLM, smol_hf) -> None:
    prompt = chat_ids(smol_llm, "Name three colours.")
    out = smol_llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        logits = smol_hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = logits.log_softmax(-1)[len(prompt) - 1:-1]  # the distribution each output token was drawn from
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert entry[token].logprob == pytest.approx(ref[step, token].item(), abs=1e-3)
        top_ids = ref[step].topk(5).indices.tolist()
        assert set(entry) == set(top_ids)
        # each token's text as the tokenizer decodes it alone (" Paris", not the vocabulary's "ĠParis")
        assert all(lp.decoded_token == smol_llm.engine.tokenizer.decode([t], skip_special_tokens=False)
                   for t, lp in entry.items())
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize("block_size,chunk", [(8, None), (16, 24)])
def test_prefix_caching_reuses_blocks_and_matches_hf(block_size: int, chunk: int | None, tiny_models) -> None:
    """Requests sharing a long prefix: later ones compute only their uncached tail, and every
    output still equals HF's; after a preemption the re-prefill finds the sequence's own blocks."""
    folder, hf = tiny_models["qwen2"]
    rng = random.Random(block_size)
    system = [rng.randrange(256) for _ in range(70)]
    prompts = [system + [rng.randrange(256) for _ in range(n)] for n in (5, 17, 1)]
    llm = LLM(folder, max_model_len=256, block_size=block_size, enable_prefix_caching=True,
              enable_chunked_prefill=chunk is not None, max_num_batched_tokens=chunk or 256)
    params = SamplingParams(temperature=0, max_tokens=12)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    assert first.num_cached_tokens == 0
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    for prompt, out in zip(prompts, [first, *rest], strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
    assert [o.num_cached_tokens for o in rest] == [70 // block_size * block_size] * 2
    # the same prompt again hits its own generated blocks too, still equal to HF
    again = llm.generate([{"prompt_token_ids": prompts[1]}], params)[0]
    assert again.num_cached_tokens == (len(prompts[1]) - 1) // block_size * block_size
    assert again.outputs[0].token_ids == rest[0].outputs[0].token_ids
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_prefix_caching_under_preemption_and_n_samples_matches_hf(tiny_models) -> None:
    folder, hf = tiny_models["llama"]
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (3, 30, 11, 22)]
    # 24 blocks of 8: four sequences growing to ~90 tokens cannot all fit, so some are preempted
    llm = LLM(folder, max_model_len=128, block_size=8, enable_prefix_caching=True, num_gpu_blocks_override=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=40))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 40)
    pair = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=8, n=2))[0]
    assert [o.token_ids for o in pair.outputs] == [hf_greedy(hf, prompts[0], 8)] * 2
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
