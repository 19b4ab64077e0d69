"""Live block-size changes under random traffic (a hypothesis state machine over a tiny model on a
small cache): arrivals, aborts, steps, preemptions in both modes, swaps, and block-size changes in
both directions. After every step no block is leaked or double-owned; across every change each
kept sequence's cached K/V is bit-for-bit what it was; every request finishes with the tokens it
gets without any change (greedy, alone on a roomy engine). A second machine runs the same with
async scheduling forced on: every rule then meets a step in flight; a third with an FP8 KV cache,
whose bytes every copy must keep as they are."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.engine.engine import LLMEngine
from kvpilot.runtime.sched.scheduler import SchedulerOutput
from kvpilot.runtime.sched.sequence import Sequence, SequenceStatus
from kvpilot.runtime.tunables import BLOCK_SIZES

MAX_LEN, MAX_TOKENS = 128, 20
BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # K and V x 3 layers x 2 KV heads x head dim 16 x fp32
_rng = random.Random(22)
_shared = [_rng.randrange(256) for _ in range(40)]  # a common prefix: prefix-cache hits across requests
PROMPTS = [_shared + [_rng.randrange(256) for _ in range(n)] for n in (0, 3, 17, 30)]
PROMPTS += [[_rng.randrange(256) for _ in range(n)] for n in (1, 9, 33, 70)]


def token_kv(engine: LLMEngine, seq: Sequence) -> torch.Tensor:
    """The K/V of `seq`'s computed tokens, read through its block table (device) or swap table (host)."""
    runner, bs, n = engine.runner, engine.runner.block_size, seq.num_computed_tokens
    swapped = seq.status is SequenceStatus.SWAPPED
    table = seq.swap_table if swapped else seq.block_table
    caches = runner.swap_space.host_kv_caches() if swapped else runner.kv_caches
    blocks = torch.tensor([table[p // bs] for p in range(n)], dtype=torch.long)
    offsets = torch.arange(n) % bs
    # as bytes: FP8 caches compare bit for bit too (the swap space holds them as bytes already)
    return torch.stack([c.view(torch.uint8)[blocks, offsets] for kv in caches for c in kv]).clone()


class BlockSwitchMachine(RuleBasedStateMachine):
    folder: str = ""
    reference: dict[tuple[int, ...], list[int]] = {}
    reference_llm: LLM | None = None
    async_scheduling = False
    kv_cache_dtype = "auto"

    @initialize(blocks=st.sampled_from([8, 10, 12]), block_size=st.sampled_from(BLOCK_SIZES),
                prefix=st.booleans(), mode=st.sampled_from(["recompute", "swap"]),
                arrivals=st.lists(st.tuples(st.sampled_from(range(len(PROMPTS))), st.integers(1, MAX_TOKENS)),
                                  min_size=2, max_size=5),
                steps=st.integers(1, 3))
    def start(self, blocks: int, block_size: int, prefix: bool, mode: str, arrivals: list[tuple[int, int]],
              steps: int) -> None:
        """An engine already serving: every example starts with requests in flight."""
        # `blocks` of 16 tokens, whatever the first block size: enough for one max-length sequence
        self.llm = LLM(self.folder, max_model_len=MAX_LEN, num_gpu_blocks_override=blocks * 16 // block_size,
                       block_size=block_size, max_num_seqs=6, preemption_mode=mode, max_num_batched_tokens=MAX_LEN,
                       swap_space=96 * BYTES_PER_TOKEN / (1 << 30), enable_prefix_caching=prefix,
                       async_scheduling=self.async_scheduling, kv_cache_dtype=self.kv_cache_dtype)
        self.engine = self.llm.engine
        self.wanted: dict[str, tuple[list[int], int]] = {}
        self.done: dict[str, list[int]] = {}
        self.next_id = 0
        self.arrive(arrivals)
        self.step(steps)

    @rule(arrivals=st.lists(st.tuples(st.sampled_from(range(len(PROMPTS))), st.integers(1, MAX_TOKENS)),
                            min_size=1, max_size=3))
    def arrive(self, arrivals: list[tuple[int, int]]) -> None:
        for prompt, max_tokens in arrivals:
            rid = f"r{self.next_id}"
            self.next_id += 1
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            self.engine.add_request(rid, PROMPTS[prompt], params)
            self.wanted[rid] = (PROMPTS[prompt], max_tokens)

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            for out in self.engine.step():
                if out.finished:
                    self.done[out.request_id] = out.outputs[0].token_ids

    # which request or sequence: an index drawn whatever the state, taken modulo what there is (a
    # draw whose shape followed the engine's state would make hypothesis's replays inconsistent)
    @precondition(lambda self: self.engine.has_unfinished_requests())
    @rule(pick=st.integers(0, 63))
    def abort(self, pick: int) -> None:
        ids = sorted(self.engine.requests)
        rid = ids[pick % len(ids)]
        self.engine.abort_request(rid)
        del self.wanted[rid]

    @rule(mode=st.sampled_from(["recompute", "swap"]))
    def preemption_mode(self, mode: str) -> None:
        self.engine.update_config({"preemption_mode": mode})

    @precondition(lambda self: self.engine.scheduler.running)
    @rule(pick=st.integers(0, 63))
    def preempt(self, pick: int) -> None:
        """A preemption as the scheduler makes one (swapped when the mode is swap and there is room),
        its copies run as the engine runs them before a step."""
        running = self.engine.scheduler.running
        seq = running[pick % len(running)]
        out = SchedulerOutput()
        self.engine.scheduler.preempt(seq, out)
        self.engine.runner.swap_blocks(out.swap_out, out.swap_in)

    @precondition(lambda self: self.engine.scheduler.running or self.engine.scheduler.swapped)
    @rule(block_size=st.sampled_from(BLOCK_SIZES))
    def change_block_size(self, block_size: int) -> None:
        engine, sched = self.engine, self.engine.scheduler
        held = [s for s in list(sched.running) + list(sched.swapped) if s.num_computed_tokens]
        before = {s.seq_id: token_kv(engine, s) for s in held}
        old = engine.runner.block_size
        applied = engine.update_config({"block_size": block_size})
        assert ("block_size" in applied) == (old != block_size)
        if old == block_size:
            return
        report = engine.last_relayout
        assert report is not None and engine.block_manager.block_size == block_size == engine.runner.block_size
        dropped = set(report.preempted) | set(report.swapped_recomputed)
        for seq in held:
            if seq.is_finished:  # async scheduling: the step in flight, resolved first, ended it
                continue
            if seq.request.request_id in dropped:
                assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
                continue
            assert seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED)
            assert torch.equal(token_kv(engine, seq), before[seq.seq_id]), seq.request.request_id
        if block_size < old:  # a split always fits
            assert not dropped

    @invariant()
    def no_block_leaked_or_double_owned(self) -> None:
        sched, bm = self.engine.scheduler, self.engine.block_manager
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in sched.running:
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
            for i, b in enumerate(seq.block_table):
                holders.setdefault(b, []).append((seq, i))
        assert all(0 <= b < bm.num_blocks for b in holders)
        for b in range(bm.num_blocks):
            assert bm.ref_counts[b] == len(holders.get(b, []))
            assert bm.is_free(b) == (b not in holders)
        bs = bm.block_size
        for owners in holders.values():  # shared only as one prefix: full, computed, same tokens
            if len(owners) > 1:
                tokens = {tuple(s.token_ids[i * bs:(i + 1) * bs]) for s, i in owners}
                assert len(tokens) == 1 and all(s.num_computed_tokens >= (i + 1) * bs for s, i in owners)
        for seq in list(sched.waiting) + list(sched.swapped):
            assert not seq.block_table
        swap = [b for seq in sched.swapped for b in seq.swap_table]
        assert sorted(swap + sched.swap_pool.free_block_ids) == list(range(sched.num_swap_blocks))
        for seq in sched.swapped:
            assert len(seq.swap_table) * bs >= seq.num_computed_tokens > 0
        for seq in list(sched.running) + list(sched.waiting):
            assert not seq.swap_table

    def teardown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    self.done[out.request_id] = out.outputs[0].token_ids
        assert not engine.has_unfinished_requests()
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
        for rid, (prompt, max_tokens) in self.wanted.items():
            assert self.done[rid] == self.expected(prompt, max_tokens), rid

    def expected(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy tokens of `prompt` alone on a roomy engine that never changes."""
        key = tuple(prompt)
        if key not in self.reference:
            cls = type(self)
            if cls.reference_llm is None:
                cls.reference_llm = LLM(self.folder, max_model_len=MAX_LEN, kv_cache_dtype=self.kv_cache_dtype)
            out = cls.reference_llm.generate({"prompt_token_ids": prompt},
                                             SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
            self.reference[key] = out[0].outputs[0].token_ids
        return self.reference[key][:max_tokens]


class AsyncBlockSwitchMachine(BlockSwitchMachine):
    async_scheduling = True


class Fp8BlockSwitchMachine(BlockSwitchMachine):
    """The same with an FP8 KV cache (its scales measured at start, the same in every engine of
    the tiny model), against FP8 references."""

    reference: dict[tuple[int, ...], list[int]] = {}
    reference_llm: LLM | None = None
    kv_cache_dtype = "fp8"


# async scheduling (a step in flight at every rule) and an FP8 cache rerun a few examples each
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("machine", "max_examples"),
                         [(BlockSwitchMachine, 25), (AsyncBlockSwitchMachine, 6), (Fp8BlockSwitchMachine, 4)],
                         ids=["sync", "async", "fp8"])
def test_block_size_changes_under_random_traffic(tiny_models, machine: type[BlockSwitchMachine],
                                                 max_examples: int) -> None:
    machine.folder = tiny_models["llama"][0]
    run_state_machine_as_test(machine, settings=settings(
        max_examples=max_examples, stateful_step_count=30, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
