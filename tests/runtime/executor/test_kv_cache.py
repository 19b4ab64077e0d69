"""Re-laying a cache in place (sched/relayout.py plans, executor/kv_cache.py copies): every kept
token's K/V reads the same through the new tables, on token-major and head-major caches, for splits
and merges, with shared prefixes, tiny batches (so ordering and cycles matter) and nearly full caches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.runtime.executor import kv_cache
from kvpilot.runtime.executor.kv_cache import KVCacheLayout
from kvpilot.runtime.sched.relayout import plan_relayout
from kvpilot.runtime.tunables import BLOCK_SIZES

HEADS, DIM = 2, 3


def tokens_of(view: torch.Tensor, table: list[int] | tuple[int, ...], block_size: int, n: int) -> torch.Tensor:
    """The (n, heads, dim) K or V of a sequence's first n tokens, read through its block table."""
    if n == 0:
        return view.new_zeros(0, HEADS, DIM)
    return torch.stack([view[table[p // block_size], p % block_size] for p in range(n)])


@st.composite
def cache_states(draw):
    old = draw(st.sampled_from(BLOCK_SIZES))
    new = draw(st.sampled_from([s for s in BLOCK_SIZES if s != old]))
    capacity = draw(st.integers(1, 8)) * 64 + draw(st.sampled_from([0, 8, 24]))  # a ragged tail too
    num_old = capacity // old
    free = draw(st.permutations(range(num_old)))
    seqs: list[tuple[list[int], int]] = []
    used = 0
    for _ in range(draw(st.integers(0, 12))):
        share = draw(st.integers(0, len(seqs))) if seqs else 0
        prefix: list[int] = []
        if share:  # a prefix-cache hit: the leading full blocks of an earlier sequence
            table, n = seqs[share - 1]
            prefix = table[:draw(st.integers(0, n // old))]
        n = len(prefix) * old + draw(st.integers(0 if prefix else 1, 3 * old))
        need = -(-n // old) - len(prefix)
        if used + need > num_old:
            break
        seqs.append((prefix + list(free[used:used + need]), n))
        used += need
    return old, new, capacity, seqs, draw(st.integers(1, 4)), draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(cache_states())
def test_relayout_keeps_every_kept_token(state) -> None:
    old, new, capacity, seqs, max_batch, head_major = state
    num_old, num_new = capacity // old, capacity // new
    flat = torch.randn(capacity * HEADS * DIM)
    before = kv_cache.block_view(flat, num_old, old, HEADS, DIM, head_major)
    expected = [tokens_of(before, t, old, n).clone() for t, n in seqs]
    plan = plan_relayout(old, new, num_old, num_new, seqs, max_batch)
    # bounded temporary memory: only a cycle with no free block to break it runs as one larger last batch
    assert all(len(batch) <= max_batch for batch in plan.batches[:-1])
    moved = kv_cache.relayout([flat], plan, HEADS, DIM, head_major)
    after = kv_cache.block_view(flat, num_new, new, HEADS, DIM, head_major)
    holders: dict[int, set[tuple]] = {}
    for i, ((_, n), table) in enumerate(zip(seqs, plan.tables, strict=True)):
        if table is None:
            continue
        assert len(table) == -(-n // new) and all(0 <= b < num_new for b in table)
        assert torch.equal(tokens_of(after, table, new, n), expected[i])
        for j, b in enumerate(table):  # a block is shared only by sequences with the same tokens in it
            holders.setdefault(b, set()).add(tuple(expected[i][j * new:(j + 1) * new].flatten().tolist()))
    assert all(len(contents) == 1 for contents in holders.values())
    if plan.dropped:  # only a merge runs out of room, and it fills the new cut
        assert new > old and len(holders) <= num_new
    if not head_major and new < old:
        assert moved == 0  # a token-major split is a re-view


@settings(max_examples=60, deadline=None)
@given(cache_states(), st.sampled_from([(torch.float16, 4), (torch.float16, 3), (torch.bfloat16, 2)]))
def test_rows_of_the_runner_storage_move_as_words_and_keep_every_kept_token(state, element) -> None:
    # allocate's storage, a row per layer's K or V; its copies move int64, int16 and int32 words
    old, new, capacity, seqs, max_batch, head_major = state
    dtype, dim = element
    num_old, num_new = capacity // old, capacity // new
    storage = torch.randn(3, capacity * HEADS * dim).to(dtype)
    before = [kv_cache.block_view(row, num_old, old, HEADS, dim, head_major) for row in storage]
    expected = [[tokens_of(b, t, old, n).clone() for t, n in seqs] for b in before]
    plan = plan_relayout(old, new, num_old, num_new, seqs, max_batch)
    kv_cache.relayout(storage, plan, HEADS, dim, head_major)
    for row, kept in zip(storage, expected, strict=True):
        after = kv_cache.block_view(row, num_new, new, HEADS, dim, head_major)
        for ((_, n), table, tokens) in zip(seqs, plan.tables, kept, strict=True):
            if table is not None:
                assert torch.equal(tokens_of(after, table, new, n), tokens)


def test_split_is_a_review_and_merge_of_aligned_blocks_moves_nothing_token_major() -> None:
    seqs = [([4, 5, 6], 40), ([0, 1], 32)]
    plan = plan_relayout(16, 8, 8, 16, seqs, max_batch=8)
    assert plan.tables == ([8, 9, 10, 11, 12], [0, 1, 2, 3])
    merge = plan_relayout(16, 32, 8, 4, seqs, max_batch=8)
    assert merge.tables[1] == [0]  # blocks 0 and 1 are new block 0 already
    flat = torch.randn(128 * HEADS * DIM)
    copy = flat.clone()
    kv_cache.relayout([flat], plan, HEADS, DIM, head_major=False)
    assert torch.equal(flat, copy)


def test_merge_that_cannot_fit_drops_the_fewest_sequences() -> None:
    # 4 blocks of 16 -> 2 blocks of 32; three sequences of one 16-token block each need 3 new blocks
    seqs = [([0], 16), ([1], 16), ([2], 10)]
    plan = plan_relayout(16, 32, 4, 2, seqs, max_batch=4)
    assert len(plan.dropped) == 1
    with pytest.raises(ValueError, match="powers of two"):
        plan_relayout(16, 24, 4, 2, seqs, max_batch=4)


def test_merge_into_a_cut_of_no_blocks_drops_every_sequence_that_holds_one() -> None:
    # a swap space of 12 blocks of 8 tokens holds no block of 128: the swapped sequences are recomputed
    plan = plan_relayout(8, 128, 12, 0, [([0, 1], 16), ([], 0), ([2], 3)], max_batch=4)
    assert plan.tables == (None, [], None) and plan.batches == ()


def test_layout_counts_blocks_from_one_allocation() -> None:
    layout = KVCacheLayout(block_size=16, num_blocks=21, capacity_tokens=336, num_layers=3, num_kv_heads=2,
                           head_dim=16, dtype=torch.float32, device="cpu", head_major=False, swap_capacity_tokens=40)
    assert layout.bytes_per_block == 2 * 3 * 2 * 16 * 4 * 16 and layout.num_swap_blocks == 2
    assert layout.swap_bytes == 40 * layout.bytes_per_token
    assert layout.with_block_size(64).num_blocks == 5 and layout.with_block_size(8).num_blocks == 42
    with pytest.raises(ValueError, match="block_size"):
        layout.with_block_size(12)
