"""Scheduler and block manager on their own: plain bookkeeping, no torch, no model."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from kvpilot.runtime.config import SchedulerConfig
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.block_manager import BlockManager
from kvpilot.runtime.sched.scheduler import Scheduler, SchedulerOutput
from kvpilot.runtime.sched.sequence import Request, Sequence
from kvpilot.runtime.tunables import BLOCK_SIZES

SEQ_IDS = itertools.count()  # an engine numbers its sequences; these tests are one engine


def make_seq(num_prompt: int, rid: str = "r") -> Sequence:
    return Request(rid, None, list(range(num_prompt)), SamplingParams(), arrival_time=0.0, seq_ids=SEQ_IDS).seqs[0]


def run_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after a step: advance computed counts, append a token when sampled."""
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        if samples:
            s.seq.token_ids.append(0)


def make(num_blocks: int = 64, block_size: int = 16, **kw) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512, **kw})
    return Scheduler(config, BlockManager(num_blocks, block_size))


def test_modules_import_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import kvpilot.runtime.sched.scheduler, kvpilot.runtime.sched.block_manager, kvpilot.runtime.args\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_long_prompt_is_chunked_and_mixed_with_decodes() -> None:
    sched = make(max_num_batched_tokens=64)
    short = make_seq(10, "short")
    sched.add(short)
    run_step(sched, sched.schedule())  # short prefilled whole, samples its first token
    long = make_seq(150, "long")
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 150:
        out = sched.schedule()
        assert out.num_batched_tokens <= 64
        by_seq = {s.seq.request.request_id: s.num_new_tokens for s in out.scheduled}
        assert by_seq["short"] == 1  # the decode runs in every step of the long prefill
        chunks.append(by_seq["long"])
        run_step(sched, out)
    assert chunks == [63, 63, 24]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make(max_num_batched_tokens=512, enable_chunked_prefill=False)
    seqs = [make_seq(300, "a"), make_seq(300, "b")]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 300)]


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make(max_num_seqs=3)
    for i in range(5):
        sched.add(make_seq(4, str(i)))
    out = sched.schedule()
    assert len(out.scheduled) == 3 and len(sched.waiting) == 2


def test_out_of_blocks_preempts_the_newest_and_frees_its_blocks() -> None:
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_seq(7, "a"), make_seq(7, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # 2 blocks each, 8 token slots: one slot of room left
    run_step(sched, sched.schedule())  # token 8 of each fits
    out = sched.schedule()  # token 9 needs a third block each: b, the newer, makes room for a
    assert out.preempted == [b]
    assert b.num_computed_tokens == 0 and b.block_table == [] and sched.waiting[0] is b
    assert [s.seq for s in out.scheduled] == [a]
    assert sched.block_manager.num_free_blocks == 1


def test_finish_returns_every_block() -> None:
    sched = make(num_blocks=32, block_size=8)
    seqs = [make_seq(n, str(n)) for n in (5, 17, 40)]
    for s in seqs:
        sched.add(s)
    for _ in range(5):
        run_step(sched, sched.schedule())
    for s in seqs:
        sched.finish(s)
    assert sched.block_manager.num_free_blocks == 32
    assert not sched.running and not sched.waiting


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_block_manager_allocates_ceil_blocks(block_size: int) -> None:
    bm = BlockManager(100, block_size)
    seq = make_seq(1)
    bm.append(seq, 1)
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 1
    bm.append(seq, block_size)
    assert len(seq.block_table) == 2
    assert bm.can_append(seq, 0) and not bm.can_append(seq, block_size * 100)
    bm.free(seq)
    assert bm.num_free_blocks == 100 and seq.block_table == []


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens.*chunked prefill"):
        SchedulerConfig(max_num_batched_tokens=100, max_model_len=512, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")


# ---- prefix cache ----------------------------------------------------------------------------


def seq_of(tokens: list[int], rid: str = "r") -> Sequence:
    return Request(rid, None, list(tokens), SamplingParams(), arrival_time=0.0, seq_ids=SEQ_IDS).seqs[0]


def computed(bm: BlockManager, seq: Sequence) -> Sequence:
    """Admit `seq` as the scheduler would, compute its whole prompt and register its blocks."""
    matched, digests = bm.match_prefix(seq)
    bm.take(seq, matched, digests)
    bm.append(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)
    return seq


def test_shared_prefix_shares_full_blocks_and_never_the_last_token() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = computed(bm, seq_of(list(range(10))))  # blocks: [0-3] [4-7] [8,9]
    b = seq_of(list(range(8)) + [99, 98, 97])
    matched, digests = bm.match_prefix(b)
    assert matched == a.block_table[:2]  # the two full blocks; the partial third is not registered
    bm.take(b, matched, digests)
    assert b.num_computed_tokens == 8 and [bm.ref_counts[x] for x in matched] == [2, 2]
    # a prompt that is exactly two cached blocks still computes its last token
    c = seq_of(list(range(8)))
    assert bm.match_prefix(c)[0] == a.block_table[:1]


def test_a_different_earlier_block_changes_every_later_digest() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    computed(bm, seq_of(list(range(12))))
    other = seq_of([7, 7, 7, 7] + list(range(4, 12)))  # same second and third blocks, new first
    assert bm.match_prefix(other) == ([], [])


def test_freed_blocks_stay_cached_until_handed_out_again() -> None:
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = computed(bm, seq_of(list(range(9))))  # 3 blocks
    kept = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4  # cached blocks count as free
    again = seq_of(list(range(9)))
    matched, _ = bm.match_prefix(again)
    assert matched == kept[:2]
    # a stranger needing every block evicts the cache, least recently freed first
    stranger = computed(bm, seq_of([50 + i for i in range(16)]))
    assert sorted(stranger.block_table) == [0, 1, 2, 3]
    assert bm.match_prefix(seq_of(list(range(9)))) == ([], [])
    bm.free(stranger)
    assert bm.num_free_blocks == 4 and not any(bm.ref_counts)


def test_can_take_counts_revived_blocks_against_the_free_pool() -> None:
    bm = BlockManager(3, 4, enable_prefix_caching=True)
    a = computed(bm, seq_of(list(range(8))))  # 2 blocks, then freed: both cached and free
    bm.free(a)
    b = seq_of(list(range(8)) + [1, 2, 3, 4, 5])
    matched, _ = bm.match_prefix(b)
    assert len(matched) == 2
    assert bm.can_take(matched, 4)  # 2 revived + 1 new = 3 free blocks
    assert not bm.can_take(matched, 5)  # would need a fourth block


def test_scheduler_admits_a_cached_prefix_with_only_its_uncached_tail() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512),
                      BlockManager(64, 16, enable_prefix_caching=True))
    first = seq_of(list(range(40)), "a")
    sched.add(first)
    run_step(sched, sched.schedule())  # prefill of 40 tokens, one token sampled
    second = seq_of(list(range(40)) + [500], "b")
    sched.add(second)
    out = sched.schedule()
    by_seq = {s.seq.request.request_id: s for s in out.scheduled}
    assert by_seq["a"].num_new_tokens == 1  # decode
    assert by_seq["b"].num_new_tokens == 41 - 32  # two 16-token blocks came from the cache
    assert second.num_cached_tokens == 32
    assert second.block_table[:2] == first.block_table[:2]
    run_step(sched, out)
    for seq in (first, second):
        sched.finish(seq)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_recompute_preemption_finds_its_own_blocks_in_the_cache() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512),
                      BlockManager(64, 16, enable_prefix_caching=True))
    seq = seq_of(list(range(40)))
    sched.add(seq)
    run_step(sched, sched.schedule())
    sched.preempt(seq)
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [41 - 32]


# ---- priority policy -------------------------------------------------------------------------


def prio_seq(num_prompt: int, rid: str, priority: int, arrival: float) -> Sequence:
    return Request(rid, None, list(range(num_prompt)), SamplingParams(), arrival_time=arrival,
                   priority=priority, seq_ids=SEQ_IDS).seqs[0]


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    sched = make(max_num_seqs=1, scheduler_policy="priority")
    seqs = [prio_seq(5, "late-low", 5, 0.0), prio_seq(5, "urgent", 0, 2.0), prio_seq(5, "next", 1, 1.0),
            prio_seq(5, "next-later", 1, 3.0)]
    for s in seqs:
        sched.add(s)
    order = []
    while sched.num_unfinished:
        out = sched.schedule()
        run_step(sched, out)
        for s in out.scheduled:
            order.append(s.seq.request.request_id)
            sched.finish(s.seq)
    assert order == ["urgent", "next", "next-later", "late-low"]


def test_fcfs_admits_by_arrival_whatever_the_priority() -> None:
    sched = make(max_num_seqs=1)
    for s in (prio_seq(5, "a", 5, 0.0), prio_seq(5, "b", 0, 1.0)):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.request.request_id for s in out.scheduled] == ["a"]


def test_priority_policy_preempts_the_least_important_even_if_older() -> None:
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64, scheduler_policy="priority")
    old_low, new_high = prio_seq(7, "old-low", 9, 0.0), prio_seq(7, "new-high", 0, 1.0)
    sched.add(old_low)
    sched.add(new_high)
    run_step(sched, sched.schedule())
    run_step(sched, sched.schedule())
    out = sched.schedule()  # both need a third block; only one fits
    assert out.preempted == [old_low]
    assert [s.seq for s in out.scheduled] == [new_high]


def test_backlog_counts_each_tenants_requests_waiting_or_swapped() -> None:
    """The per-tenant backlog kept as sequences move equals a count over the queues, through
    admissions, swap preemptions and swap-ins, recompute preemptions, finishes and aborts."""
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=512, preemption_mode="swap")
    sched = Scheduler(config, BlockManager(12, 8), num_swap_blocks=64)

    def counted() -> dict[str, int]:
        requests = {s.request for s in itertools.chain(sched.waiting, sched.swapped)}
        return {t: sum(1 for r in requests if r.tenant == t) for t in {r.tenant for r in requests}}

    for i in range(8):  # three tenants; some requests have two samples
        request = Request(f"r{i}", None, list(range(10 + i)), SamplingParams(n=2 if i % 3 == 0 else 1),
                          arrival_time=float(i), tenant=f"t{i % 3}", seq_ids=SEQ_IDS)
        for seq in request.seqs:
            sched.add(seq)
    assert sched.backlog == counted() == {"t0": 3, "t1": 3, "t2": 2}
    swapped_out = swapped_in = recomputed = 0
    aborted_swapped = False
    for step in range(200):
        out = sched.schedule()
        swapped_out += out.num_swapped_out
        swapped_in += len(out.swap_in) > 0
        recomputed += len(out.preempted) - out.num_swapped_out
        run_step(sched, out)
        if step == 20:
            sched.config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=512)
        for s in out.scheduled:
            if s.seq.num_output_tokens >= 24 and not s.seq.is_finished:
                sched.finish(s.seq)
        if step % 7 == 6 and sched.waiting:  # an abort of a queued sequence now and then
            sched.finish(sched.waiting[-1])
        if sched.swapped and swapped_out == 2:  # and of a swapped one, once
            sched.finish(sched.swapped[-1])
            aborted_swapped = True
        assert sched.backlog == counted(), step
        if not sched.num_unfinished:
            break
    assert swapped_out and swapped_in and recomputed and aborted_swapped and sched.backlog == {}


def test_the_waiting_queue_is_ordered_only_when_a_sequence_can_be_admitted() -> None:
    sched = make(max_num_seqs=1, scheduler_policy="priority")
    first, second = make_seq(8, "first"), make_seq(8, "second")
    sched.add(first)
    sched.add(second)
    orders = []
    admission = sched.policy.admission
    sched.policy.admission = lambda waiting: orders.append(len(waiting)) or admission(waiting)  # type: ignore[method-assign]
    run_step(sched, sched.schedule())  # first admitted
    run_step(sched, sched.schedule())  # the batch is full: the queue of one is left as it is
    assert orders == [2]
    sched.finish(first)
    out = sched.schedule()
    assert orders == [2, 1] and [s.seq for s in out.scheduled] == [second]
