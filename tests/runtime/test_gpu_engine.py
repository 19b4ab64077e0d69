"""The engine on CUDA, through the Triton kernels and decode CUDA graphs: greedy output equals HF
transformers (CPU, float32) token for token on tiny random models, at every block size, with
chunked prefill, padded graph batches and a live block-size change (graphs recaptured); eager mode
gives the same tokens; a bf16 engine finishes a mixed batch and returns every block; an FP8 KV
cache keeps its tokens through block-size switches and swaps. Skipped without CUDA (CI has none:
these run on a GPU machine, `benchmarks/run_on_gpu.sh`)."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch
from tiny_models import hf_greedy, make_tiny_model

from kvpilot.kernels.paged_attention import launcher, tma_decode
from kvpilot.kernels.triton_ops import TritonOps
from kvpilot.runtime import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, object]]:
    out = {}
    for kind in ("llama", "qwen2", "llama3-rope"):
        folder = tmp_path_factory.mktemp(kind)
        out[kind] = (str(folder), make_tiny_model(Path(folder), kind))
    return out


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kind,block_size", [("llama", 8), ("qwen2", 16), ("llama3-rope", 32), ("llama", 64)])
def test_float32_on_cuda_matches_hf(kind: str, block_size: int, models, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, hf = models[kind]
    # the decode graphs record the TMA kernel where it can read the caches (Hopper, block 16/32)
    # and the context is not split; these few sequences split it (programs short of the chip), so
    # at block 16 and 32 the split is turned off to have the TMA kernel recorded and checked
    # against HF, while 8 and 64 check the split-KV path. The TMA launcher is wrapped, not
    # replaced, to see that it was recorded.
    unsplit = block_size in tma_decode.BLOCK_SIZES
    if unsplit:
        monkeypatch.setattr(launcher, "choose_num_splits", lambda *args, **kwargs: 1)
    tma_launches: list[int] = []
    real = tma_decode.launch
    monkeypatch.setattr(tma_decode, "launch", lambda *args: tma_launches.append(1) or real(*args))
    monkeypatch.delenv("KVPILOT_DECODE_TMA", raising=False)
    llm = LLM(folder, device="cuda", dtype="float32", max_model_len=256, block_size=block_size,
              enable_chunked_prefill=True, max_num_batched_tokens=48, max_num_seqs=4,
              gpu_memory_utilization=0.2)
    runner = llm.engine.runner
    assert isinstance(runner.ops, TritonOps)
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4]
    batch = prompts(block_size, [1, 9, 70, 150, 33])
    # different lengths: the decode batch shrinks 4 -> 3 (a padded graph) -> 2 -> 1 as requests end
    lengths = [24, 17, 24, 9, 13]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        [SamplingParams(temperature=0, max_tokens=n) for n in lengths])
    for prompt, out, n in zip(batch, outs, lengths, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, n)
    assert runner.graphs.replays > 0
    # the start size's graphs are captured at start (the others after Ready, by the server's core)
    tma_readable = (any(size in tma_decode.BLOCK_SIZES for size in runner.captured_block_sizes)
                    and torch.cuda.get_device_capability()[0] >= 9)
    assert bool(tma_launches) == (tma_readable and unsplit)
    assert_all_blocks_free(llm)


def test_eager_mode_gives_the_graphs_tokens(models) -> None:
    folder, _ = models["qwen2"]
    batch = prompts(11, [3, 50, 120, 7, 64, 30])
    params = SamplingParams(temperature=0, max_tokens=20)
    tokens = {}
    for eager in (False, True):
        llm = LLM(folder, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=6,
                  enforce_eager=eager, gpu_memory_utilization=0.2)
        assert (llm.engine.runner.graphs is None) == eager
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
        if not eager:
            assert llm.engine.runner.graphs.sizes == [1, 2, 4, 6]
            assert llm.engine.runner.graphs.replays > 0
        del llm
        gc.collect()  # the engine holds reference cycles: free its memory before the next one sizes its cache
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]


def test_live_block_size_change_on_cuda_keeps_output(models) -> None:
    folder, hf = models["llama"]
    llm = LLM(folder, device="cuda", dtype="float32", max_model_len=256, block_size=16, gpu_memory_utilization=0.2)
    batch = prompts(7, [5, 40, 120])
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [hf_greedy(hf, p, 16) for p in batch]
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)] == expected
    graphs_before = llm.engine.runner.graphs
    llm.engine.update_config({"block_size": 32})
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs is not graphs_before  # each size has its own graphs
    assert graphs.block_tables.shape[1] == 256 // 32
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)] == expected
    assert graphs.replays > 0
    # switches mid-generation re-lay the head-major cache in place: no sequence is recomputed
    engine = llm.engine
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    for step in range(100):
        if step in (3, 6, 9, 12):
            size = {3: 8, 6: 64, 9: 32, 12: 16}[step]
            engine.update_config({"block_size": size})
            assert engine.last_relayout is not None and engine.last_relayout.preempted == []
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert [done[str(i)] for i in range(len(batch))] == expected
    assert engine.runner.graphs is graphs_before  # captured once at start, reused after the switches
    assert_all_blocks_free(llm)


def test_bf16_on_cuda_runs_a_mixed_batch_and_frees_every_block(models) -> None:
    folder, hf = models["llama"]
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_model_len=256, enable_chunked_prefill=True,
              max_num_batched_tokens=64, gpu_memory_utilization=0.2)
    batch = prompts(3, [2, 17, 100, 200, 64, 5])
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0, max_tokens=20))
    # bf16 rounding may flip a late argmax; the first tokens of peaky tiny models agree with HF
    for prompt, out in zip(batch, outs, strict=True):
        assert len(out.outputs[0].token_ids) == 20
        assert out.outputs[0].token_ids[:2] == hf_greedy(hf, prompt, 2)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_async_scheduling_on_cuda_gives_the_synchronous_outputs(models, preemption_mode: str) -> None:
    """The default on CUDA overlaps the host's step N+1 with the device's step N (engine.py): the
    same engine with it switched off gives the same tokens, stops and logprobs, under preemption."""
    folder, hf = models["llama"]
    llm = LLM(folder, device="cuda", dtype="float32", max_model_len=256, block_size=16, num_gpu_blocks_override=20,
              preemption_mode=preemption_mode, swap_space=0.01, max_num_seqs=8, gpu_memory_utilization=0.2)
    engine = llm.engine
    assert engine.async_scheduling and engine.runner.graphs is not None
    batch = prompts(5, [3, 40, 90, 12, 60, 25, 7, 33])
    plain = SamplingParams(temperature=0, max_tokens=40)
    sync_plain = [o.outputs[0].token_ids for o in
                  llm.generate([{"prompt_token_ids": p} for p in batch], plain)]  # warm: graphs and kernels
    stop_id = sync_plain[0][5]
    params = [plain, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0.9, top_p=0.9, max_tokens=30, seed=3),
              SamplingParams(temperature=0, max_tokens=12, logprobs=2),
              SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=8)] + [plain] * 3

    def run() -> tuple[list[object], list[float]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        seen = [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs and [sorted(e) for e in c.logprobs])
                 for c in o.outputs] for o in outs]
        values = [lp.logprob for o in outs for c in o.outputs for e in c.logprobs or [] for lp in e.values()]
        return seen, values

    overlapped, overlapped_lps = run()
    engine.async_scheduling = False
    synchronous, synchronous_lps = run()
    engine.async_scheduling = True
    assert overlapped == synchronous
    assert overlapped_lps == pytest.approx(synchronous_lps, abs=1e-3)
    assert engine.scheduler.num_preemptions > 0
    assert overlapped[0][0][0] == hf_greedy(hf, batch[0], 40)
    assert_all_blocks_free(llm)


def test_a_live_raise_of_max_num_seqs_captures_graphs_for_the_larger_batch(models) -> None:
    """The decode graphs follow max_num_seqs, not the start's value: after 4 -> 12 a batch of 12
    replays a graph (it would run eagerly on graphs of 4), with HF's tokens; a raise of
    max_num_batched_tokens past what the memory was sized for is refused, changing nothing."""
    folder, hf = models["llama"]
    llm = LLM(folder, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=512, gpu_memory_utilization=0.2)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.max_batch == 4
    llm.engine.update_config({"max_num_seqs": 12})
    graphs = runner.graphs
    assert graphs is not None and graphs.max_batch == 12 and graphs.sizes == [1, 2, 4, 8, 12]
    assert all(runner._graph_sets.get(size).max_batch == 12 for size in runner.captured_block_sizes)  # noqa: SLF001
    batch = prompts(13, [5 + 7 * i for i in range(12)])
    params = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in batch]
    assert graphs.replays > 0
    before = llm.engine.live_config()
    with pytest.raises(ValueError, match="max_num_batched_tokens: at most 512 on this engine"):
        llm.engine.update_config({"max_num_batched_tokens": 1024, "max_num_seqs": 2})
    assert llm.engine.live_config() == before
    assert_all_blocks_free(llm)


def test_fp8_kv_cache_on_cuda_keeps_its_tokens_through_switches_and_swaps(models) -> None:
    """--kv-cache-dtype fp8 on CUDA (decode graphs, the TMA kernel where it reads the cache): the
    first token agrees with HF's float32 one wherever HF's top two logits are 0.3 apart (the tiny
    model's near-ties may flip under FP8, as under any rounding); block-size switches
    mid-generation, and swap preemptions in a tight engine, give exactly the tokens of a run
    without them (their copies move the FP8 bytes unchanged)."""
    folder, hf = models["llama"]
    batch = prompts(5, [5, 40, 120, 33])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(folder, device="cuda", dtype="float32", max_model_len=256, block_size=16, kv_cache_dtype="fp8",
              gpu_memory_utilization=0.2)
    runner, engine = llm.engine.runner, llm.engine
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn and runner.graphs is not None
    assert runner.kv_scales_source is not None and runner.kv_scales_source.startswith("measured")
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
    clear = 0
    for prompt, tokens in zip(batch, expected, strict=True):
        with torch.no_grad():
            top = hf(torch.tensor([prompt])).logits[0, -1].topk(2)  # type: ignore[operator]
        if top.values[0] - top.values[1] > 0.3:
            assert tokens[0] == top.indices[0].item()
            clear += 1
    assert clear >= 2
    assert runner.graphs.replays > 0
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    for step in range(100):
        if step in (3, 6, 9, 12):
            engine.update_config({"block_size": {3: 8, 6: 64, 9: 32, 12: 16}[step]})
            assert engine.last_relayout is not None and engine.last_relayout.preempted == []
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert [done[str(i)] for i in range(len(batch))] == expected
    assert_all_blocks_free(llm)
    del llm, runner, engine
    gc.collect()  # the engine holds reference cycles: free its memory before the next one sizes its cache
    torch.cuda.empty_cache()
    tight = LLM(folder, device="cuda", dtype="float32", max_model_len=256, block_size=16, kv_cache_dtype="fp8",
                num_gpu_blocks_override=17, preemption_mode="swap", swap_space=0.01, max_num_seqs=4,
                gpu_memory_utilization=0.2)
    swapped_out = []
    swap = tight.engine.runner.swap_blocks
    tight.engine.runner.swap_blocks = lambda out, back: swapped_out.append(len(out)) or swap(out, back)  # type: ignore[method-assign]
    outs = tight.generate([{"prompt_token_ids": p} for p in batch], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(swapped_out) > 0
    assert_all_blocks_free(tight)
