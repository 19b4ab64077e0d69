"""Async scheduling (engine.py): the engine schedules and queues step N+1 before it has step N's
tokens, and postprocesses N afterwards. On the CPU the device work is done when it returns, but the
pipeline runs all the same when forced on: what it returns must be what the synchronous engine
returns, and greedy tokens what HF computes, through EOS mid-batch, stops, seeds, n > 1, logprobs,
aborts, preemptions, prefix caching and live changes."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tiny_models import hf_greedy

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.config import DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvpilot.runtime.outputs import RequestOutput


def summary(outputs: list[RequestOutput]) -> list[Any]:
    """Everything a user sees of each sample, logprobs rounded (batches of other sizes differ in
    the last bits)."""
    def lps(entries: Any) -> Any:
        if entries is None:
            return None
        return [{t: (round(lp.logprob, 3), lp.rank) for t, lp in e.items()} for e in entries]
    return [(o.finished, [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
                                         lps(c.logprobs)) for c in o.outputs]) for o in outputs]


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_the_default_is_on_with_cuda_only() -> None:
    model = ModelConfig(model="m", served_model_name="m")
    assert EngineConfig(model, device=DeviceConfig(device="cuda")).async_scheduling
    assert not EngineConfig(model, device=DeviceConfig(device="cpu")).async_scheduling
    assert not EngineConfig(model, device=DeviceConfig(device="cuda", tensor_parallel_size=2)).async_scheduling
    forced = SchedulerConfig(async_scheduling=True)
    assert EngineConfig(model, scheduler=forced, device=DeviceConfig(device="cpu")).async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model, scheduler=forced, device=DeviceConfig(device="cuda", tensor_parallel_size=2))


@pytest.mark.parametrize("flags,wanted", [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)])
def test_the_flag_reaches_the_scheduler_config(flags: list[str], wanted: bool | None) -> None:
    from kvpilot.runtime.args import EngineArgs
    from kvpilot.runtime.cli import build_parser

    args = EngineArgs.from_cli(build_parser().parse_args(["serve", *flags]))
    assert args.async_scheduling is wanted
    assert args.create_engine_config().scheduler.async_scheduling is wanted


def test_a_mixed_batch_gives_what_the_synchronous_engine_gives(smol_llm: LLM) -> None:
    """One batch of every kind of request, some ending at EOS mid-batch while others run on; the
    same engine with async scheduling off, then on (a switch between steps, as no setting does)."""
    engine = smol_llm.engine
    assert engine.tokenizer is not None and not engine.async_scheduling
    chats = ["What is 2+2?", "Name a colour.", "Say hi."]
    prompts: list[Any] = [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                                               add_generation_prompt=True) for c in chats]
    params = [SamplingParams(temperature=0, max_tokens=24) for _ in chats]  # EOS at different steps
    story = "Once upon a time, in a land far away,"
    prompts += [story] * 8
    params += [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, stop=[" the", "."]),
        SamplingParams(temperature=0, max_tokens=16, stop=[","], include_stop_str_in_output=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=11),
        SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=4),
        SamplingParams(temperature=0, max_tokens=4, logprobs=3),
        SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=8, min_tokens=6, stop_token_ids=[13]),
    ]
    sync = smol_llm.generate(prompts, params)
    engine.async_scheduling = True
    try:
        overlapped = smol_llm.generate(prompts, params)
    finally:
        engine.async_scheduling = False
    assert summary(overlapped) == summary(sync)
    reasons = [c.finish_reason for o in sync[:len(chats)] for c in o.outputs]
    assert "stop" in reasons  # some chats did end at EOS, mid-batch
    assert all_blocks_free(smol_llm) and not engine.has_unfinished_requests()


def test_outputs_come_one_step_later_and_no_step_runs_past_max_tokens(tiny_models) -> None:
    folder, _ = tiny_models["llama"]

    def per_step(async_scheduling: bool) -> tuple[list[Any], int]:
        engine = LLM(folder, max_model_len=128, async_scheduling=async_scheduling).engine
        engine.add_request("short", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        engine.add_request("long", [4, 5, 6], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        steps, tokens = [], 0
        while engine.has_unfinished_requests():
            steps.append([(o.request_id, len(o.outputs[0].token_ids)) for o in engine.step(finished_only=True)])
            tokens += engine.last_step.num_batched_tokens if engine.last_step else 0
        return steps, tokens

    sync_steps, sync_tokens = per_step(False)
    assert sync_steps == [[], [("short", 2)], [], [], [("long", 5)]]
    async_steps, async_tokens = per_step(True)
    assert async_steps == [[], *sync_steps]
    assert async_tokens == sync_tokens  # a sequence its pending token ends is not run again


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generation_stops_at_max_model_len(tiny_models, async_scheduling: bool) -> None:
    folder, hf = tiny_models["llama"]
    llm = LLM(folder, max_model_len=64, async_scheduling=async_scheduling)
    prompt = list(range(60))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=100))[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == hf_greedy(hf, prompt, 4)


def test_greedy_tokens_match_hf_with_prefix_caching_in_two_waves(tiny_models) -> None:
    folder, hf = tiny_models["qwen2"]
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (1, 7, 20, 33)]
    llm = LLM(folder, max_model_len=256, block_size=8, enable_prefix_caching=True, async_scheduling=True)
    lengths = [5, 17, 9, 24]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                         [SamplingParams(temperature=0, max_tokens=n) for n in lengths[:2]])
    second = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          [SamplingParams(temperature=0, max_tokens=n) for n in lengths])
    assert all(o.num_cached_tokens > 0 for o in second)  # the second wave hit the prefix cache
    for outs in (first, second):
        for o, p, n in zip(outs, prompts, lengths, strict=False):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, n)
    assert all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_memory_pressure_keeps_greedy_tokens(tiny_models, mode: str) -> None:
    folder, hf = tiny_models["llama"]
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (30, 12, 45, 20, 8, 37)]
    llm = LLM(folder, max_model_len=128, block_size=8, num_gpu_blocks_override=24, preemption_mode=mode,
              swap_space=0.01, async_scheduling=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and (sched.num_swapped_out > 0) == (mode == "swap")
    for o, p in zip(outs, prompts, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 40)
    assert all_blocks_free(llm)


def test_aborts_between_steps_free_at_once_and_drop_the_token_in_flight(tiny_models) -> None:
    folder, hf = tiny_models["mistral"]
    engine = LLM(folder, max_model_len=128, async_scheduling=True).engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("gone", [1, 2, 3, 4], params)
    engine.add_request("kept", [5, 6, 7], params)
    engine.add_request("pair", [8, 9], SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True))
    seen: dict[str, RequestOutput] = {}
    for _ in range(4):
        seen |= {o.request_id: o for o in engine.step()}
    before = engine.block_manager.num_free_blocks
    engine.abort_request("gone")  # its next token is in flight
    engine.abort_request("pair", indices=[0])  # one sample ends (a stop string the API process found)
    assert engine.block_manager.num_free_blocks > before
    while engine.has_unfinished_requests():
        seen |= {o.request_id: o for o in engine.step()}
    assert seen["gone"].finished is False  # no output after the abort
    assert seen["kept"].outputs[0].token_ids == hf_greedy(hf, [5, 6, 7], 12)
    pair = seen["pair"].outputs
    assert pair[0].finish_reason == "abort" and pair[1].finish_reason == "length"
    assert pair[1].token_ids == hf_greedy(hf, [8, 9], 12)
    assert pair[0].token_ids == pair[1].token_ids[:len(pair[0].token_ids)]  # no placeholder, no dropped token
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_drained_steps_last_outputs_come_out(tiny_models) -> None:
    """A live change resolves the step in flight; when that ends every request, its outputs still
    come out of the next step."""
    folder, _ = tiny_models["llama"]
    engine = LLM(folder, max_model_len=128, async_scheduling=True).engine
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    engine.step()  # the second token is in flight
    engine.update_config({"max_num_seqs": 4})
    assert not engine.requests and engine.has_unfinished_requests()
    [out] = engine.step()
    assert out.request_id == "a" and out.finished and len(out.outputs[0].token_ids) == 2
    assert not engine.has_unfinished_requests()
