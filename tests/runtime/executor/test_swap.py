"""The swap space (executor/swap.py): whole blocks across all layers go out to host memory and come
back bit-identical, in either per-block layout and in chunks when staging is small; and, in the
engine, copies left in flight as long as the CUDA ordering allows (emulated here on the CPU: a
copy runs only when a later step's forward pass or a later copy must see it) leave every
sequence's KV bit-identical and greedy outputs equal to a run without memory pressure."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from kvpilot.kernels.reference import kv_cache_empty
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.executor import kv_cache, model_runner
from kvpilot.runtime.executor.kv_cache import KVCacheLayout
from kvpilot.runtime.executor.swap import SwapSpace, block_view
from kvpilot.runtime.sched.scheduler import SchedulerOutput
from kvpilot.runtime.sched.sequence import Sequence

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 3, 2, 8


def allocated_caches(num_blocks: int, block_size: int,
                     head_major: bool) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Random caches cut from one allocation as the runner's are (kv_cache.allocate), and their
    stacked view, through which the swap space moves all layers with one gather."""
    layout = KVCacheLayout(block_size=block_size, num_blocks=num_blocks, capacity_tokens=num_blocks * block_size,
                           num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                           device="cpu", head_major=head_major, swap_capacity_tokens=0)
    storage = kv_cache.allocate(layout, layout.capacity_tokens)
    storage.copy_(torch.randn(storage.shape))
    return kv_cache.views(storage, layout), kv_cache.stacked_view(storage, layout)


def random_caches(num_blocks: int, block_size: int, head_major: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random caches, each layer's K and V its own tensor."""
    def one() -> torch.Tensor:
        cache = kv_cache_empty(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, head_major=head_major,
                               dtype=torch.float32, device="cpu")
        cache.copy_(torch.randn(cache.shape))
        return cache
    return [(one(), one()) for _ in range(NUM_LAYERS)]


def block_bytes(block_size: int) -> int:
    return 2 * NUM_LAYERS * block_size * NUM_KV_HEADS * HEAD_DIM * 4


@pytest.mark.parametrize("one_allocation", [True, False])
@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("staging_blocks", [2, 64])
def test_blocks_round_trip_bit_identical_into_other_device_blocks(head_major: bool, staging_blocks: int,
                                                                  one_allocation: bool) -> None:
    caches, stacked = (allocated_caches(12, 8, head_major) if one_allocation
                       else (random_caches(num_blocks=12, block_size=8, head_major=head_major), None))
    before = [(k.clone(), v.clone()) for k, v in caches]
    space = SwapSpace(caches, swap_bytes=16 * block_bytes(8), staging_bytes=staging_blocks * block_bytes(8),
                      stacked=stacked)
    assert space.num_blocks == 16 and space.num_staging_blocks == min(staging_blocks, 16)
    out = [(7, 3), (2, 4), (9, 5), (0, 11), (5, 12)]  # host runs 3-5 and 11-12
    space.swap(out, [])
    for k, v in caches:  # the step reuses the device blocks
        k.zero_()
        v.zero_()
    back = [(3, 1), (4, 8), (5, 10), (11, 6), (12, 0)]
    space.swap([], back)
    space.before_forward()
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        for (dev_out, _), (_, dev_in) in zip(out, back, strict=True):
            assert torch.equal(k[dev_in], k0[dev_out]) and torch.equal(v[dev_in], v0[dev_out])
    stats = space.take_stats()
    assert (stats.num_blocks_out, stats.num_blocks_in) == (5, 5)
    assert space.take_stats().num_blocks_out == 0


@pytest.mark.parametrize("one_allocation", [True, False])
@pytest.mark.parametrize("head_major", [True, False])
def test_host_views_have_the_device_caches_shape_and_per_block_layout(head_major: bool, one_allocation: bool) -> None:
    caches, stacked = (allocated_caches(6, 8, head_major) if one_allocation
                       else (random_caches(num_blocks=6, block_size=8, head_major=head_major), None))
    space = SwapSpace(caches, swap_bytes=4 * block_bytes(8), stacked=stacked)
    space.swap([(5, 2)], [])
    host = space.host_kv_caches()
    assert len(host) == NUM_LAYERS
    for layer, ((k, v), (hk, hv)) in enumerate(zip(caches, host, strict=True)):
        assert hk.shape == (4, 8, NUM_KV_HEADS, HEAD_DIM)
        assert hk.stride()[1:] == k.stride()[1:]
        assert torch.equal(hk[2], k[5]) and torch.equal(hv[2], v[5])
        # the same elements in the same order: the device block's raw run, whole
        assert torch.equal(space.host[2, layer, 0], block_view(k)[5])


def test_a_new_block_size_re_cuts_the_same_host_memory() -> None:
    space = SwapSpace(random_caches(num_blocks=8, block_size=8, head_major=True), swap_bytes=10 * block_bytes(8))
    pointer = space.host.data_ptr()
    space.bind(random_caches(num_blocks=16, block_size=4, head_major=True))
    assert space.host.data_ptr() == pointer and space.num_blocks == 20


def test_the_host_memory_is_allocated_when_first_needed() -> None:
    """Not by the engine's start (seconds of pinning on CUDA): by the first transfer, or by the
    work after Ready; a block-size change with nothing swapped out needs none either."""
    caches, stacked = allocated_caches(num_blocks=16, block_size=8, head_major=True)
    space = SwapSpace(caches, swap_bytes=10 * block_bytes(8), stacked=stacked)
    assert not space.host_allocated and space.num_blocks == 10
    large, large_stacked = allocated_caches(num_blocks=8, block_size=16, head_major=True)
    assert space.recut(large, [], large_stacked) == 0 and not space.host_allocated and space.num_blocks == 5
    space.swap([(3, 4)], [])
    assert space.host_allocated
    pointer = space.host.data_ptr()
    space.allocate_host()
    assert space.host.data_ptr() == pointer
    assert torch.equal(space.host[4].flatten(0, 1), large_stacked[3])  # K0, V0, K1, ...: the stacked order


@pytest.mark.parametrize("head_major", [True, False])
def test_the_stacked_view_holds_each_block_of_every_layer_as_its_own_cache_does(head_major: bool) -> None:
    caches, stacked = allocated_caches(5, 8, head_major)
    assert stacked.shape == (5, 2 * NUM_LAYERS, 8 * NUM_KV_HEADS * HEAD_DIM)
    for i, cache in enumerate(c for kv in caches for c in kv):
        assert torch.equal(stacked[:, i], block_view(cache))
    with pytest.raises(ValueError, match="stacked view"):  # another allocation's view
        SwapSpace(caches, swap_bytes=4 * block_bytes(8), stacked=stacked.clone())


def host_tokens(space: SwapSpace, table: list[int], num_tokens: int) -> torch.Tensor:
    """(layers, 2, tokens, heads, dim): a swapped sequence's K/V read through its host table."""
    bs = space.host_kv_caches()[0][0].shape[1]
    return torch.stack([torch.stack([c[table[p // bs], p % bs] for p in range(num_tokens)])
                        for kv in space.host_kv_caches() for c in kv])


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize(("old", "new"), [(8, 4), (4, 16), (16, 8)])
def test_a_recut_keeps_each_swapped_sequence_tokens_in_its_new_blocks(head_major: bool, old: int, new: int) -> None:
    space = SwapSpace(random_caches(num_blocks=4, block_size=old, head_major=head_major), swap_bytes=96 * block_bytes(1))
    space.host.copy_(torch.randn(space.host.shape))
    seqs = [([5, 1, 3], 2 * old + 3), ([0, 4], old), ([2], 1)]  # scattered old blocks, partial last blocks
    seqs = [(t, min(n, len(t) * old)) for t, n in seqs]
    expected = [host_tokens(space, t, n) for t, n in seqs]
    free = iter(random.Random(old * new).sample(range(96 // new), 96 // new))
    moves = [(t, [next(free) for _ in range(-(-n // new))], n) for t, n in seqs]
    written = space.recut(random_caches(num_blocks=4, block_size=new, head_major=head_major), moves)
    assert space.num_blocks == 96 // new
    for (_, table, n), tokens in zip(moves, expected, strict=True):
        assert torch.equal(host_tokens(space, table, n), tokens)
    assert written == sum(t.numel() for t in expected) * 4
    with pytest.raises(ValueError, match="cannot hold"):
        space.recut(random_caches(num_blocks=4, block_size=new, head_major=head_major), [([0], [1], new + 1)])


def test_a_block_that_is_not_one_dense_run_is_refused() -> None:
    cache = torch.zeros(4, 8, 2, 16)[:, :, :, :8]  # every row of head_dim cut in half
    with pytest.raises(ValueError, match="dense run"):
        block_view(cache)


class DeferredSwapSpace(SwapSpace):
    """The CUDA ordering, emulated on the CPU with every copy left in flight as long as it may be:
    a copy of step k runs only when a later copy must follow it (the side stream's order) or
    before the forward pass of a step after k (the event that pass waits for). The gather of a
    swap-out runs at once, as the compute stream waits for it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.queue: list[tuple[int, str, Callable[[], None]]] = []  # (step, kind, copy)
        self.num_steps = 0
        self.in_flight_at_forward = {"store": 0, "load": 0}
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        self.num_steps += 1
        super().swap(swap_out, swap_in)

    def _gather(self, chunk: list[tuple[int, int]]) -> None:
        self._flush(self.num_steps + 1)
        super()._gather(chunk)

    def _store(self, chunk: list[tuple[int, int]]) -> None:
        self.queue.append((self.num_steps, "store", lambda: SwapSpace._store(self, chunk)))

    def _load(self, chunk: list[tuple[int, int]]) -> None:
        self.queue.append((self.num_steps, "load", lambda: SwapSpace._load(self, chunk)))

    def _flush(self, before_step: int) -> None:
        """Run the queued copies issued before step `before_step`, in order."""
        while self.queue and self.queue[0][0] < before_step:
            self.queue.pop(0)[2]()

    def before_forward(self) -> None:
        self._flush(self.num_steps)  # this step's copies stay in flight through its forward pass
        for kind in {kind for _, kind, _ in self.queue}:
            self.in_flight_at_forward[kind] += 1
        super().before_forward()

    def synchronize(self) -> None:
        if hasattr(self, "queue"):  # called by SwapSpace.__init__ before ours has run
            self._flush(self.num_steps + 1)
        super().synchronize()


def seq_kv(runner: model_runner.ModelRunner, seq: Sequence, num_tokens: int) -> torch.Tensor:
    """(num_layers, 2, num_tokens, num_kv_heads, head_dim): the KV of `seq`'s first tokens."""
    bs = runner.block_size
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(seq.block_table)[positions // bs]
    return torch.stack([torch.stack([k[blocks, positions % bs], v[blocks, positions % bs]])
                        for k, v in runner.kv_caches])


def run_tracking_kv(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Step the engine; before every forward pass, check that each scheduled sequence's cached KV is
    bit-identical to what was written when its tokens were computed. Returns the outputs."""
    engine, runner = llm.engine, llm.engine.runner
    written: dict[int, torch.Tensor] = {}  # seq id -> KV of its computed tokens, as first written
    launch, schedule = runner.launch, engine.scheduler.schedule
    last: list[SchedulerOutput] = []

    def recorded_schedule() -> SchedulerOutput:
        last[:] = [schedule()]
        return last[0]

    def checked_launch(inputs):  # type: ignore[no-untyped-def]
        runner.swap_space.before_forward()  # what the forward pass waits for (it is idempotent)
        for s in last[0].scheduled:
            ref = written.get(s.seq.seq_id)
            if ref is not None and s.seq.num_computed_tokens:
                n = min(ref.shape[2], s.seq.num_computed_tokens)
                assert torch.equal(seq_kv(runner, s.seq, n), ref[:, :, :n]), f"seq {s.seq.seq_id} KV changed"
        return launch(inputs)

    engine.scheduler.schedule = recorded_schedule  # type: ignore[method-assign]
    runner.launch = checked_launch  # type: ignore[method-assign]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        for seq in engine.scheduler.running:  # record what this step computed
            known = written.get(seq.seq_id)
            done = 0 if known is None else known.shape[2]
            if seq.num_computed_tokens > done:
                new = seq_kv(runner, seq, seq.num_computed_tokens)[:, :, done:]
                written[seq.seq_id] = new if known is None else torch.cat([known, new], dim=2)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def test_copies_in_flight_during_the_next_step_leave_every_sequence_kv_bit_identical(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_runner, "SwapSpace", DeferredSwapSpace)
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (40, 70, 25, 90, 55, 33)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    # 32 blocks of 8 = 256 slots for six sequences that grow to 85..150 tokens each
    llm = LLM("tiny-llama", load_format="dummy", max_model_len=256, block_size=8, num_gpu_blocks_override=32,
              preemption_mode="swap", swap_space=0.01, max_num_batched_tokens=64)
    outs = run_tracking_kv(llm, prompts, params)
    space, sched = llm.engine.runner.swap_space, llm.engine.scheduler
    assert isinstance(space, DeferredSwapSpace)
    assert sched.num_preemptions > 0 and sched.num_swapped_out == sched.num_preemptions
    assert space.in_flight_at_forward["store"] > 0 and space.in_flight_at_forward["load"] > 0

    roomy = LLM("tiny-llama", load_format="dummy", max_model_len=256, block_size=8, max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert roomy.engine.scheduler.num_preemptions == 0
    assert outs == expected
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and sched.swap_pool.num_free_blocks == sched.num_swap_blocks


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_on_cuda_bf16_blocks_round_trip_through_pinned_memory_on_the_side_stream() -> None:
    def cache() -> torch.Tensor:
        c = kv_cache_empty(64, 16, NUM_KV_HEADS, HEAD_DIM, head_major=True, dtype=torch.bfloat16, device="cuda")
        c.copy_(torch.randn(c.shape, device="cuda"))
        return c
    caches = [(cache(), cache()) for _ in range(NUM_LAYERS)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    per_block = block_bytes(16) // 2  # bf16
    space = SwapSpace(caches, swap_bytes=40 * per_block, staging_bytes=8 * per_block)
    assert space.host.is_pinned()
    device_out = random.Random(0).sample(range(64), 20)
    space.swap(list(zip(device_out, range(20), strict=True)), [])
    for k, v in caches:  # the compute stream reuses the blocks right away: it waited for the gathers only
        k.zero_()
        v.zero_()
    device_in = list(range(40, 60))
    space.swap([], list(zip(range(20), device_in, strict=True)))
    space.swap([], [])  # the next step
    space.before_forward()
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k[device_in], k0[device_out]) and torch.equal(v[device_in], v0[device_out])
    torch.cuda.synchronize()
    stats = space.take_stats()
    assert stats.num_blocks_out == stats.num_blocks_in == 20 and stats.seconds_out > 0 and stats.seconds_in > 0


@pytest.mark.gpu
@cuda
def test_on_cuda_copies_overlapping_the_steps_leave_every_sequence_kv_bit_identical() -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (40, 70, 25, 90, 55, 33)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    kw = dict(load_format="dummy", device="cuda", dtype="float32", max_model_len=256, block_size=8,
              max_num_batched_tokens=64)
    llm = LLM("tiny-llama", num_gpu_blocks_override=32, preemption_mode="swap", swap_space=0.01, **kw)
    outs = run_tracking_kv(llm, prompts, params)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.num_swapped_out == sched.num_preemptions
    roomy = LLM("tiny-llama", **kw)
    expected = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert outs == expected
