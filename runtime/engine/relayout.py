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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

Write = tuple[int, tuple[int, ...]]  # merge: (new block, old blocks copied into it in order); split: (old block, (old block,))


@dataclass(frozen=True)
class RelayoutPlan:
    """What to do to one cache tensor (plain data: it is broadcast to tensor-parallel ranks)."""

    old_block_size: int
    new_block_size: int
    num_old_blocks: int
    num_new_blocks: int
    batches: tuple[tuple[Write, ...], ...]  # run in order; within a batch every read precedes every write
    tables: tuple[tuple[int, ...] | None, ...]  # each input sequence's new table; None: it does not fit

    @property
    def is_split(self) -> bool:
        return self.new_block_size < self.old_block_size

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
    kept: list[list[int]] = []
    for table, num_tokens in sequences:
        n = -(-num_tokens // old_block_size)
        if n > len(table):
            raise ValueError(f"a table of {len(table)} blocks cannot hold {num_tokens} tokens")
        kept.append(table[:n])
    if new_block_size == old_block_size:
        return RelayoutPlan(old_block_size, new_block_size, num_old_blocks, num_new_blocks, (),
                            tuple(tuple(t) for t in kept))
    if new_block_size < old_block_size:
        return _plan_split(old_block_size, new_block_size, num_old_blocks, num_new_blocks, kept, sequences, max_batch)
    return _plan_merge(old_block_size, new_block_size, num_old_blocks, num_new_blocks, kept, sequences, max_batch)


def _plan_split(old: int, new: int, num_old: int, num_new: int, kept: list[list[int]],
                sequences: list[tuple[list[int], int]], max_batch: int) -> RelayoutPlan:
    k = old // new
    if num_new < num_old * k:
        raise ValueError(f"{num_old} blocks of {old} do not fit in {num_new} blocks of {new}")
    tables = []
    for blocks, (_, num_tokens) in zip(kept, sequences, strict=True):
        split = [k * b + i for b in blocks for i in range(k)]
        tables.append(tuple(split[:-(-num_tokens // new)]))
    live = sorted({b for blocks in kept for b in blocks})
    writes = [(b, (b,)) for b in live]
    batches = tuple(tuple(writes[i:i + max_batch]) for i in range(0, len(writes), max_batch))
    return RelayoutPlan(old, new, num_old, num_new, batches, tuple(tables))


def _plan_merge(old: int, new: int, num_old: int, num_new: int, kept: list[list[int]],
                sequences: list[tuple[list[int], int]], max_batch: int) -> RelayoutPlan:
    k = new // old
    if num_new * k > num_old:
        raise ValueError(f"{num_new} blocks of {new} do not fit in {num_old} blocks of {old}")
    seq_groups = [[tuple(blocks[i:i + k]) for i in range(0, len(blocks), k)] for blocks in kept]
    alive = _fit(seq_groups, num_new)
    groups: list[tuple[int, ...]] = list(dict.fromkeys(g for i in alive for g in seq_groups[i]))
    dest = _place(groups, k, num_new)
    batches = _order(groups, dest, k, num_new, max_batch)
    target = {g: dest[j] for j, g in enumerate(groups)}
    tables: list[tuple[int, ...] | None] = [None] * len(kept)
    for i in alive:
        tables[i] = tuple(target[g] for g in seq_groups[i])
    return RelayoutPlan(old, new, num_old, num_new, batches, tuple(tables))


def _fit(seq_groups: list[list[tuple[int, ...]]], capacity: int) -> list[int]:
    """The sequences kept when the distinct groups exceed `capacity`: drop the fewest, each time
    the one whose removal frees the most groups (ties: the latest)."""
    holders: dict[tuple[int, ...], int] = defaultdict(int)
    for gs in seq_groups:
        for g in set(gs):
            holders[g] += 1
    alive = set(range(len(seq_groups)))
    while len(holders) > capacity:
        victim = max(alive, key=lambda i: (sum(1 for g in set(seq_groups[i]) if holders[g] == 1), i))
        alive.discard(victim)
        for g in set(seq_groups[victim]):
            holders[g] -= 1
            if holders[g] == 0:
                del holders[g]
    return sorted(alive)


def _place(groups: list[tuple[int, ...]], k: int, num_new: int) -> list[int]:
    """A new block for each group: where most of its old blocks already sit in order, else one whose
    memory holds no live block, else any left."""
    def in_place(g: tuple[int, ...], r: int) -> int:
        return sum(1 for i, b in enumerate(g) if b == k * r + i)

    dest = [-1] * len(groups)
    taken: set[int] = set()
    ranked = []
    for j, g in enumerate(groups):
        homes = {b // k for i, b in enumerate(g) if b % k == i and b // k < num_new}
        if homes:
            r = max(homes, key=lambda r: (in_place(g, r), -r))
            ranked.append((-in_place(g, r), j, r))
    for _, j, r in sorted(ranked):
        if r not in taken:
            dest[j] = r
            taken.add(r)
    live_regions = {b // k for g in groups for b in g}
    spare = [r for r in range(num_new) if r not in taken]
    spare.sort(key=lambda r: r in live_regions)  # empty memory first: nothing to order around
    it = iter(spare)
    for j in range(len(groups)):
        if dest[j] < 0:
            dest[j] = next(it)
    return dest


def _order(groups: list[tuple[int, ...]], dest: list[int], k: int, num_new: int,
           max_batch: int) -> tuple[tuple[Write, ...], ...]:
    """Batches of writes such that a write to new block r comes no earlier than every other write
    reading old blocks inside r's memory (Kahn's order over "is read by")."""
    n = len(groups)
    writer_of = {dest[j]: j for j in range(n)}
    readers: list[set[int]] = [set() for _ in range(n)]  # readers[j]: other writes reading dest[j]'s memory
    reads: list[set[int]] = [set() for _ in range(n)]  # reads[j]: regions write j reads (its own excluded)
    for j, g in enumerate(groups):
        for b in g:
            r = b // k
            if r != dest[j] and r < num_new:
                reads[j].add(r)
                if r in writer_of:
                    readers[writer_of[r]].add(j)
    pending_readers = [len(s) for s in readers]
    region_reads: dict[int, int] = defaultdict(int)  # pending reads per region
    for j in range(n):
        for r in reads[j]:
            region_reads[r] += 1
    ready = [j for j in range(n) if pending_readers[j] == 0]
    done = [False] * n
    order: list[list[int]] = []
    current: list[int] = []

    def emit(j: int) -> None:
        done[j] = True
        current.append(j)
        if len(current) == max_batch:
            order.append(list(current))
            current.clear()
        for r in reads[j]:
            region_reads[r] -= 1
            w = writer_of.get(r)
            if w is not None and not done[w]:
                pending_readers[w] -= 1
                if pending_readers[w] == 0:
                    ready.append(w)

    remaining = n
    free = [r for r in range(num_new) if r not in writer_of]
    while remaining:
        while ready:
            emit(ready.pop())
            remaining -= 1
        if not remaining:
            break
        # every write left is in a cycle or behind one: send one of them to a free block
        j = next(j for j in range(n) if not done[j])
        spare = next((r for r in free if region_reads.get(r, 0) == 0), None)
        if spare is not None:
            free.remove(spare)
            del writer_of[dest[j]]
            free.append(dest[j])
            dest[j] = spare
            writer_of[spare] = j
            readers[j] = set()
            pending_readers[j] = 0
            ready.append(j)
            continue
        # no free block at all: the rest runs as one batch (all its reads precede its writes)
        if current:
            order.append(list(current))
            current.clear()
        rest = [j for j in range(n) if not done[j]]
        for j in rest:
            done[j] = True
        order.append(rest)
        remaining = 0
    if current:
        order.append(current)
    return tuple(tuple((dest[j], groups[j]) for j in batch) for batch in order)
