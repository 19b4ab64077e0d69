"""Scheduler and block manager on their own: plain bookkeeping, no torch, no model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpilot.runtime.block_manager import BlockManager
from kvpilot.runtime.config import SchedulerConfig
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.scheduler import Scheduler, SchedulerOutput
from kvpilot.runtime.sequence import Request, Sequence


def make_seq(num_prompt: int, rid: str = "r") -> Sequence:
    return Request(rid, None, list(range(num_prompt)), SamplingParams(), arrival_time=0.0).seqs[0]


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
            "import kvpilot.runtime.scheduler, kvpilot.runtime.block_manager, kvpilot.runtime.args\n")
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


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
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
