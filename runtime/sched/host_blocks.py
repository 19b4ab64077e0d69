"""The swap space's blocks, as the scheduler hands them out. No torch.

A sequence swapped out gets host blocks for its whole block table. The copies move each run of
consecutive host blocks with one transfer (executor/swap.py), so the pool hands out one run when
it has one long enough (the first that fits) and otherwise the lowest free ids, which keeps runs
long as the pool fragments.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from itertools import filterfalse


class HostBlockPool:
    def __init__(self, num_blocks: int, used: Collection[int] = ()) -> None:
        """`num_blocks` host blocks, all free but `used` (swapped sequences kept across a re-cut)."""
        self.num_blocks = num_blocks
        used = set(used)
        # every id from `_tail` up is free without being listed: the swap space of a small model
        # holds millions of blocks, and every block-size change (and the start-up's) makes a pool
        self._tail = max(used) + 1 if used else 0
        self._free: list[int] = list(filterfalse(used.__contains__, range(self._tail)))  # sorted, below _tail

    @property
    def free_block_ids(self) -> list[int]:
        return self._free + list(range(self._tail, self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._tail

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free_blocks

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks (call can_allocate first): a run of consecutive ids if one fits."""
        start = self._first_run(count)
        if start is None:
            start = 0  # no run is long enough: the lowest ids
        self._list(start + count)
        blocks = self._free[start:start + count]
        del self._free[start:start + count]
        return blocks

    def _first_run(self, count: int) -> int | None:
        """Where in the free ids, in order, the first run of `count` consecutive ids starts, if any
        (the unlisted ids from `_tail` up are one run, which the listed ids' last run may join)."""
        free, run_start = self._free, 0
        for i in range(len(free)):
            if i > 0 and free[i] != free[i - 1] + 1:
                run_start = i
            if i - run_start + 1 == count:
                return run_start
        start = run_start if free and free[-1] == self._tail - 1 else len(free)
        return start if len(free) - start + self.num_blocks - self._tail >= count else None

    def _list(self, length: int) -> None:
        """List unlisted ids, lowest first, until `length` are (or none is left)."""
        extra = min(length - len(self._free), self.num_blocks - self._tail)
        if extra > 0:
            self._free.extend(range(self._tail, self._tail + extra))
            self._tail += extra

    def free(self, blocks: list[int]) -> None:
        for block_id in blocks:
            bisect.insort(self._free, block_id)
