"""Swap preemption against recompute in the scheduler alone (no torch, no model): under memory
pressure swap must not preempt more often, sequences come back one step ahead of running, only
while the running ones keep room to grow, and into host blocks handed out as contiguous runs."""

from __future__ import annotations

import itertools

import pytest

from kvpilot.runtime.config import SchedulerConfig
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.block_manager import BlockManager
from kvpilot.runtime.sched.host_blocks import HostBlockPool
from kvpilot.runtime.sched.scheduler import SWAP_IN_HORIZON, Scheduler, SchedulerOutput
from kvpilot.runtime.sched.sequence import Request, Sequence, SequenceStatus

SEQ_IDS = itertools.count()  # an engine numbers its sequences; these tests are one engine


def make_seq(num_prompt: int, rid: str, max_tokens: int = 1000, arrival: float = 0.0) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, None, [1] * num_prompt, params, arrival_time=arrival, seq_ids=SEQ_IDS).seqs[0]


def advance(sched: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """What the engine does after a step; returns the sequences that finished."""
    finished = []
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        if samples:
            s.seq.token_ids.append(2)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                sched.finish(s.seq)
                finished.append(s.seq)
    return finished


def replay(mode: str, num_requests: int, prompt_len: int, output_len: int, num_blocks: int, block_size: int,
           arrive_every: int) -> int:
    """A stream of equal requests, one every `arrive_every` steps, over a cache too small for the
    batch the scheduler admits; returns the number of preemptions."""
    config = SchedulerConfig(max_num_batched_tokens=2048, max_model_len=4096, preemption_mode=mode)
    sched = Scheduler(config, BlockManager(num_blocks, block_size), num_swap_blocks=100_000)
    step = added = done = 0
    while done < num_requests:
        if added < num_requests and step % arrive_every == 0:
            sched.add(make_seq(prompt_len, f"r{added}", output_len, arrival=float(added)))
            added += 1
        out = sched.schedule()
        step += 1
        done += len(advance(sched, out))
        assert step < 100_000, "the workload did not finish"
    assert sched.swap_pool.num_free_blocks == 100_000 and sched.block_manager.num_free_blocks == num_blocks
    if mode == "swap":
        assert sched.num_swapped_out == sched.num_preemptions
    return sched.num_preemptions


@pytest.mark.parametrize("workload", [
    # the served workload of the swap issue: 1,024 in / 512 out over a 48k-token cache (block 16)
    dict(num_requests=240, prompt_len=1024, output_len=512, num_blocks=3072, block_size=16, arrive_every=7),
    dict(num_requests=80, prompt_len=200, output_len=200, num_blocks=300, block_size=8, arrive_every=3),
    dict(num_requests=80, prompt_len=100, output_len=300, num_blocks=200, block_size=16, arrive_every=2),
    dict(num_requests=100, prompt_len=64, output_len=256, num_blocks=120, block_size=8, arrive_every=1),
], ids=["issue-1024-512", "block-8", "long-outputs", "tiny-cache"])
def test_swap_does_not_preempt_more_than_recompute_under_memory_pressure(workload: dict[str, int]) -> None:
    recompute = replay("recompute", **workload)
    swap = replay("swap", **workload)
    assert recompute > 0  # the cache is under pressure
    assert swap <= recompute


def test_a_swapped_in_sequence_runs_from_the_next_step() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, preemption_mode="swap"),
                      BlockManager(100, 4), num_swap_blocks=64)
    a, b = make_seq(30, "a"), make_seq(30, "b")
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    sched.preempt(b, SchedulerOutput())  # as the running loop does when blocks run out
    assert b.status is SequenceStatus.SWAPPED and b.num_computed_tokens == 30
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a]  # b's copy is in flight during this step
    assert [d for _, d in out.swap_in] == b.block_table and b.status is SequenceStatus.RUNNING
    advance(sched, out)
    out = sched.schedule()
    assert {s.seq.request.request_id: s.num_new_tokens for s in out.scheduled} == {"a": 1, "b": 1}
    assert b.num_computed_tokens == 30  # nothing recomputed


def test_swap_in_waits_until_the_running_sequences_keep_their_headroom() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, preemption_mode="swap"),
                      BlockManager(100, 4), num_swap_blocks=100)
    running, swapped = make_seq(8, "running"), make_seq(8, "swapped")
    sched.add(running)
    sched.add(swapped)
    advance(sched, sched.schedule())  # both prefilled: 9 tokens, 2 blocks of 4 each
    sched.preempt(swapped, SchedulerOutput())
    bm = sched.block_manager
    # once `running` takes its third block for token 9, it needs blocks for 9 + HORIZON tokens;
    # `swapped` needs as many to hold its own 9 + HORIZON
    own = bm.num_blocks_for(9 + SWAP_IN_HORIZON)
    headroom = own - 3
    hog, spare = make_seq(1, "hog"), make_seq(1, "spare")
    hog.block_table = bm.allocate(bm.num_free_blocks - own - headroom - 1)
    spare.block_table = bm.allocate(1)
    out = sched.schedule()  # one block short after running's append (the old rule needed 3 blocks)
    assert not out.swap_in and sched.swapped[0] is swapped
    advance(sched, out)
    bm.free(spare)
    out = sched.schedule()
    assert len(out.swap_in) == 2 and not sched.swapped


def test_host_blocks_are_handed_out_as_contiguous_runs() -> None:
    pool = HostBlockPool(16)
    first, second, third = pool.allocate(4), pool.allocate(4), pool.allocate(4)
    assert first == [0, 1, 2, 3] and second == [4, 5, 6, 7]
    pool.free(first)
    pool.free(third[1:3])  # free: 0-3, 9, 10, 12-15
    assert pool.allocate(4) == [0, 1, 2, 3]  # the first run that fits
    assert pool.allocate(3) == [12, 13, 14]
    assert pool.allocate(3) == [9, 10, 15]  # no run of three left: the lowest ids
    assert pool.num_free_blocks == 0 and not pool.can_allocate(1)
