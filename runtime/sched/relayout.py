"""Planning a live block-size change in place. No torch.

The KV cache is one allocation of `capacity` token slots per layer, cut into `capacity //
block_size` blocks; block b is the contiguous run of slots [b * size, (b + 1) * size). Changing the
size re-cuts the same memory, so the sequences' blocks must be re-laid into blocks of the new size
and their block tables rewritten. Sizes are powers of two, so with k = larger / smaller:

* split (new = old / k): old block b holds exactly the new blocks k*b .. k*b+k-1. A table
  [b0, b1, ...] becomes [k*b0, .., k*b0+k-1, k*b1, ...] cut to the tokens kept, and no block moves
  (on a head-major cache each kept old block is permuted inside its own memory: kv_cache.py).
* merge (new = old * k): new block r is the memory of old blocks k*r .. k*r+k-1. A sequence's
  old blocks are taken k at a time ("groups"); each distinct group gets one new block, its old
  blocks copied into it in order. Groups already sitting in place stay; the others go to a
  block chosen to overwrite nothing still to be read. The copies are ordered into batches
  (kv_cache.py runs each batch as gather-then-scatter, so a batch may read what it overwrites)
  such that no batch overwrites a block a later batch reads; a batch holds at most `max_batch`
  new blocks, which bounds the temporary memory. A cycle of copies is broken by sending one of
  them to a free block; only when none is free does a cycle run as one larger batch.

Sequences sharing full blocks (prefix caching) share the re-laid ones: a split shares every sub-
block, a merge shares a new block when the whole group is shared, else each holder gets its copy.
When the new cut cannot hold every sequence (a merge rounds each sequence's last group up), the
planner names the fewest sequences to drop, those freeing the most blocks first.

The same plan applies to the host swap space (swapped sequences' `swap_table`s), which has the
same per-block layout.

The planning is done on numpy index arrays (a full H200 cache holds over 100,000 blocks of 8, and
a switch pauses every request): per-block Python loops are left only where a merge must drop
sequences or break a cycle of copies, both rare.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: a switch builds block-manager structures of one entry per
    block (over 100,000), and the collections their allocations set off would walk the whole heap
    while every request waits. What it leaves is collected after, as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True, eq=False)
class Writes:
    """One batch of copies: write i fills block dst[i] of the larger size from old blocks src[i]
    (a split: src[i] == [dst[i]], the old block permuted in its own memory; a merge: the new
    block's old blocks in order, -1 past a sequence's last block)."""

    dst: np.ndarray  # (n,) int64
    src: np.ndarray  # (n, k) int64

    def __len__(self) -> int:
        return len(self.dst)


@dataclass(frozen=True)
class RelayoutPlan:
    """What to do to one cache tensor (plain data: it is broadcast to tensor-parallel ranks)."""

    old_block_size: int
    new_block_size: int
    num_old_blocks: int
    num_new_blocks: int
    batches: tuple[Writes, ...]  # run in order; within a batch every read precedes every write
    tables: tuple[list[int] | None, ...]  # each input sequence's new table; None: it does not fit

    @property
    def ratio(self) -> int:
        return max(self.old_block_size, self.new_block_size) // min(self.old_block_size, self.new_block_size)

    @property
    def dropped(self) -> list[int]:
        """Indices of the input sequences that the new cut cannot hold."""
        return [i for i, t in enumerate(self.tables) if t is None]


def plan_relayout(old_block_size: int, new_block_size: int, num_old_blocks: int, num_new_blocks: int,
                  sequences: list[tuple[list[int], int]], max_batch: int) -> RelayoutPlan:
    """Plan re-laying `sequences` — each (block table, number of leading tokens to keep) — from
    blocks of `old_block_size` to blocks of `new_block_size` over the same memory."""
    for size in (old_block_size, new_block_size):
        if size <= 0 or size & (size - 1):
            raise ValueError(f"block sizes must be powers of two, not {size}")
    if max_batch <= 0:
        raise ValueError(f"max_batch must be positive, not {max_batch}")
    counts = np.array([-(-n // old_block_size) for _, n in sequences], dtype=np.int64)
    for (table, n), count in zip(sequences, counts.tolist(), strict=True):
        if count > len(table):
            raise ValueError(f"a table of {len(table)} blocks cannot hold {n} tokens")
    flat = np.fromiter(itertools.chain.from_iterable(t[:c] for (t, _), c in zip(sequences, counts.tolist(), strict=True)),
                       dtype=np.int64, count=int(counts.sum()))  # every kept old block, sequence by sequence
    args = (old_block_size, new_block_size, num_old_blocks, num_new_blocks)
    if new_block_size == old_block_size:
        return RelayoutPlan(*args, (), _cut(flat.tolist(), counts, counts))
    new_counts = np.array([-(-n // new_block_size) for _, n in sequences], dtype=np.int64)
    if new_block_size < old_block_size:
        return _plan_split(*args, flat, counts, new_counts, max_batch)
    return _plan_merge(*args, flat, counts, new_counts, max_batch)


def _cut(values: list[int], widths: np.ndarray, keep: np.ndarray) -> tuple[list[int], ...]:
    """`values` cut into consecutive runs of `widths`, each run's first `keep` entries."""
    starts = (np.cumsum(widths) - widths).tolist()
    return tuple(values[s:s + n] for s, n in zip(starts, keep.tolist(), strict=True))


def _plan_split(old: int, new: int, num_old: int, num_new: int, flat: np.ndarray, counts: np.ndarray,
                new_counts: np.ndarray, max_batch: int) -> RelayoutPlan:
    k = old // new
    if num_new < num_old * k:
        raise ValueError(f"{num_old} blocks of {old} do not fit in {num_new} blocks of {new}")
    split = (flat[:, None] * k + np.arange(k)).ravel().tolist()  # old block b -> new blocks k*b .. k*b+k-1
    live = np.sort(flat)
    live = live[np.concatenate((live[:1] == live[:1], live[1:] != live[:-1]))]  # shared blocks once
    batches = tuple(Writes(live[i:i + max_batch], live[i:i + max_batch, None]) for i in range(0, len(live), max_batch))
    return RelayoutPlan(old, new, num_old, num_new, batches, _cut(split, counts * k, new_counts))


def _plan_merge(old: int, new: int, num_old: int, num_new: int, flat: np.ndarray, counts: np.ndarray,
                new_counts: np.ndarray, max_batch: int) -> RelayoutPlan:
    k = new // old
    if num_new * k > num_old:
        raise ValueError(f"{num_new} blocks of {new} do not fit in {num_old} blocks of {old}")
    # each sequence's kept blocks k at a time: group rows padded with -1, sequence by sequence
    num_seqs = len(counts)
    group_counts = -(-counts // k)
    firsts = np.cumsum(counts) - counts
    group_firsts = np.cumsum(group_counts) - group_counts
    within = np.arange(len(flat)) - np.repeat(firsts, counts)
    rows = np.full((int(group_counts.sum()), k), -1, dtype=np.int64)
    rows.reshape(-1)[np.repeat(group_firsts * k, counts) + within] = flat
    if not len(rows):
        return RelayoutPlan(old, new, num_old, num_new, (), tuple([] for _ in range(num_seqs)))
    groups, group_of = _unique_rows(rows)  # shared groups once
    alive = np.ones(num_seqs, dtype=bool)
    if len(groups) > num_new:
        alive = _fit([group_of[f:f + c].tolist() for f, c in zip(group_firsts, group_counts, strict=True)],
                     len(groups), num_new)
        held = np.zeros(len(groups), dtype=bool)
        held[group_of[np.repeat(alive, group_counts)]] = True
        remap = np.cumsum(held) - 1
        groups, group_of = groups[held], np.where(held[group_of], remap[group_of], -1)
    dest = _place(groups, k, num_new)
    batches, dest = _order(groups, dest, k, num_new, max_batch)
    # (a cut of no blocks, e.g. a swap space smaller than one new block, holds no group: all dropped)
    placed = dest[np.maximum(group_of, 0)] if len(dest) else np.full(len(group_of), -1)
    targets = _cut(placed.tolist(), group_counts, group_counts)
    tables = tuple(t if ok else None for t, ok in zip(targets, alive.tolist(), strict=True))
    return RelayoutPlan(old, new, num_old, num_new, batches, tables)


def _unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows, sorted, and each row's index among them (np.unique(axis=0) does the same
    but imports numpy.ma on its first call: tens of milliseconds of the first switch's pause)."""
    order = np.lexsort(rows.T[::-1])
    ranked = rows[order]
    first = np.ones(len(rows), dtype=bool)
    first[1:] = (ranked[1:] != ranked[:-1]).any(axis=1)
    inverse = np.empty(len(rows), dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ranked[first], inverse


def _fit(seq_groups: list[list[int]], num_groups: int, capacity: int) -> np.ndarray:
    """Which sequences are kept when their `num_groups` distinct groups exceed `capacity`: drop the
    fewest, each time the one whose removal frees the most groups (ties: the latest)."""
    holders = [0] * num_groups
    owned = [set(gs) for gs in seq_groups]
    for gs in owned:
        for g in gs:
            holders[g] += 1
    alive = set(range(len(seq_groups)))
    left = num_groups
    while left > capacity:
        victim = max(alive, key=lambda i: (sum(1 for g in owned[i] if holders[g] == 1), i))
        alive.discard(victim)
        for g in owned[victim]:
            holders[g] -= 1
            left -= holders[g] == 0
    kept = np.zeros(len(seq_groups), dtype=bool)
    kept[sorted(alive)] = True
    return kept


def _place(groups: np.ndarray, k: int, num_new: int) -> np.ndarray:
    """A new block for each group (n, k): where most of its old blocks already sit in order
    (ties: the lowest), the groups with most blocks in place served first; else one whose memory
    holds no live block; else any left."""
    n = len(groups)
    home = np.where((groups >= 0) & (groups % k == np.arange(k)) & (groups // k < num_new), groups // k, -1)
    in_place = ((home[:, :, None] == home[:, None, :]) & (home[:, None, :] >= 0)).sum(2)  # (n, k)
    in_place[home < 0] = 0
    best = np.argmax(in_place * (num_new + 1) - home, axis=1)  # most in place, then the lowest block
    rows = np.arange(n)
    r, score = home[rows, best], in_place[rows, best]
    dest = np.full(n, -1, dtype=np.int64)
    cand = np.flatnonzero(score > 0)
    cand = cand[np.lexsort((cand, -score[cand]))]
    _, first = np.unique(r[cand], return_index=True)  # each block to the first group that wants it
    dest[cand[first]] = r[cand[first]]
    taken = np.zeros(num_new, dtype=bool)
    taken[dest[dest >= 0]] = True
    live = np.zeros(num_new, dtype=bool)
    regions = groups[groups >= 0] // k
    live[regions[regions < num_new]] = True
    spare = np.concatenate((np.flatnonzero(~taken & ~live), np.flatnonzero(~taken & live)))  # empty memory first
    homeless = np.flatnonzero(dest < 0)
    dest[homeless] = spare[:len(homeless)]
    return dest


def _order(groups: np.ndarray, dest: np.ndarray, k: int, num_new: int,
           max_batch: int) -> tuple[tuple[Writes, ...], np.ndarray]:
    """Batches of writes such that a write to new block r comes no earlier than every other write
    reading old blocks inside r's memory (Kahn's order over "is read by", a level at a time), and
    the final targets (a write in a cycle may move to a free block)."""
    n = len(groups)
    dest = dest.copy()
    writer_of = np.full(num_new, -1, dtype=np.int64)
    writer_of[dest] = np.arange(n)
    reads = np.where(groups >= 0, groups // k, -1)
    reads[(reads == dest[:, None]) | (reads >= num_new)] = -1  # its own memory: read before written
    reads.sort(axis=1)
    reads[:, 1:][reads[:, 1:] == reads[:, :-1]] = -1  # each region once per write
    reader, col = np.nonzero(reads >= 0)
    region = reads[reader, col]
    pending_reads = np.bincount(region, minlength=num_new)  # per region, by writes not yet run
    writer = writer_of[region]
    blocked = np.bincount(writer[writer >= 0], minlength=n)  # per write, readers of its target not yet run
    done = np.zeros(n, dtype=bool)
    levels: list[np.ndarray] = []
    rest = None
    remaining = n
    while remaining:
        ready = np.flatnonzero(~done & (blocked == 0))
        if len(ready):
            levels.append(ready)
            done[ready] = True
            remaining -= len(ready)
            ran = np.isin(reader, ready)
            np.subtract.at(pending_reads, region[ran], 1)
            unblocked = writer_of[region[ran]]
            np.subtract.at(blocked, unblocked[unblocked >= 0], 1)
            continue
        # every write left is in a cycle or behind one: send as many of them as there are free
        # blocks to those (at once: one at a time costs a pass over every write per cycle)
        spare = np.flatnonzero((writer_of < 0) & (pending_reads == 0))
        if len(spare):
            moved = np.flatnonzero(~done)[:len(spare)]
            writer_of[dest[moved]] = -1
            dest[moved] = spare[:len(moved)]
            writer_of[dest[moved]] = moved
            blocked[moved] = 0
            continue
        rest = np.flatnonzero(~done)  # no free block at all: one batch (all its reads precede its writes)
        remaining = 0
    flat = np.concatenate(levels) if levels else np.zeros(0, dtype=np.int64)
    chunks = [flat[i:i + max_batch] for i in range(0, len(flat), max_batch)]
    if rest is not None:
        chunks.append(rest)
    return tuple(Writes(dest[c], groups[c]) for c in chunks), dest
