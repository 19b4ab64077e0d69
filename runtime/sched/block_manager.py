"""Block bookkeeping for the paged KV cache, with an optional prefix cache. No torch.

The KV cache is `num_blocks` blocks of `block_size` token slots. A sequence holds the blocks in
its `block_table`, in order: token position p lives in slot `block_table[p // block_size] *
block_size + p % block_size`. Blocks carry reference counts; a block returns to the free pool
when its count reaches zero.

Prefix caching (`enable_prefix_caching`): once a block is full and computed, it is registered
under a digest of its tokens chained with its parent's digest (SHA-256, so one digest stands for
the whole prefix up to the block's end and crafted prompts cannot collide with another user's
prefix). A new sequence whose leading blocks match registered digests takes those blocks (their
counts go up) instead of computing them again. A freed block keeps its contents and its digest
while it waits in the free pool, least recently freed first, and is evicted (digest dropped) only
when it is handed out again. Cached but unreferenced blocks count as free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from itertools import chain

import numpy as np

from kvpilot.runtime.sched.sequence import Sequence


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """The digest of a full block: its token ids chained with the digest of the prefix before it."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, not {num_blocks}")
        # the cut, as the runner's KV layout (its owner) has it: this torch-free side cannot read the
        # layout, so it is handed it here and at every re-cut (`reconfigure`); the engine reads the layout's
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # blocks freed since the cut was made, least recently freed first (they may hold a cached prefix)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict()
        # free blocks of a fresh cut (here and in `reconfigure`), handed out before free_block_ids,
        # lowest id first (popped from the end): the order one OrderedDict of them would give,
        # without one of 100,000 entries to build, or to drop at the first block-size change
        self._fresh: list[int] = list(range(num_blocks - 1, -1, -1))
        self.ref_counts = [0] * num_blocks
        self.block_digests: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self._fresh)

    def is_free(self, block_id: int) -> bool:
        """Whether `block_id` is in the pool (a check for tests: O(num_blocks) after a re-cut)."""
        return block_id in self.free_block_ids or block_id in self._fresh

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain to hold `num_new_tokens` more computed tokens."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) + reserve <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the blocks for `num_new_tokens` more tokens (call can_append first)."""
        count = self.num_new_blocks(seq, num_new_tokens)
        if count:  # a decode needs none on most steps
            seq.block_table.extend(self.allocate(count))

    def allocate(self, count: int) -> list[int]:
        """`count` blocks from the pool, each held once (least recently freed first)."""
        blocks = []
        for _ in range(count):
            if self._fresh:
                block_id = self._fresh.pop()  # holds no cached prefix: nothing to evict
            else:
                block_id, _ = self.free_block_ids.popitem(last=False)
                self._evict(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks; unshared ones go back to the pool (last block first,
        so a prefix's tail is evicted before its head)."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.prefix_digests = []

    def reconfigure(self, num_blocks: int, block_size: int, holders: list[Sequence]) -> None:
        """Blocks re-cut to `block_size` (the cache was re-laid in place: sched/relayout.py):
        `holders` are the sequences with blocks, their tables already rewritten. Reference counts
        and the free pool follow from those tables; the prefix cache is rebuilt from the holders'
        computed blocks (cached blocks that no sequence held are dropped with the old cut)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, not {num_blocks}")
        held = np.fromiter(chain.from_iterable(seq.block_table for seq in holders), dtype=np.int64)
        counts = np.bincount(held, minlength=num_blocks)  # (numpy: one entry per block, over 100,000)
        if len(counts) > num_blocks:
            raise ValueError(f"a holder's table names block {int(held.max())} of {num_blocks}")
        self.num_blocks, self.block_size, self.ref_counts = num_blocks, block_size, counts.tolist()
        self.free_block_ids = OrderedDict()
        self._fresh = np.flatnonzero(counts == 0)[::-1].tolist()
        self.block_digests = [None] * num_blocks
        self.cached = {}
        for seq in holders:
            seq.prefix_digests = []
            self.register_computed(seq)

    # ---- prefix cache ---------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """The cached blocks holding `seq`'s leading full blocks, in order, and their digests
        (none when caching is off, or while its prompt's logits are wanted: sequence.py). The
        last token is never matched: its logits must be computed."""
        if not self.enable_prefix_caching or seq.block_table or seq.needs_prompt_logits:
            return [], []
        matched: list[int] = []
        digests: list[bytes] = []
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            digest = block_digest(digests[-1] if digests else b"", seq.token_ids[i * bs:(i + 1) * bs])
            block_id = self.cached.get(digest)
            if block_id is None:
                break
            matched.append(block_id)
            digests.append(digest)
        return matched, digests

    def can_take(self, matched: list[int], num_new_tokens: int) -> bool:
        """Whether a sequence can take `matched` and then blocks for `num_new_tokens` more tokens."""
        revived = sum(1 for b in matched if self.ref_counts[b] == 0)
        needed = self.num_blocks_for(len(matched) * self.block_size + num_new_tokens) - len(matched)
        return needed + revived <= self.num_free_blocks

    def take(self, seq: Sequence, matched: list[int], digests: list[bytes]) -> None:
        """Give `seq` the matched blocks; their tokens count as computed."""
        for block_id in matched:
            if self.ref_counts[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table = list(matched)
        seq.prefix_digests = list(digests)
        seq.num_computed_tokens = len(matched) * self.block_size

    def register_computed(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that are now full and computed (call between steps)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(seq.prefix_digests), full):
            parent = seq.prefix_digests[-1] if seq.prefix_digests else b""
            digest = block_digest(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.prefix_digests.append(digest)
            block_id = seq.block_table[i]
            if self.block_digests[block_id] is None and digest not in self.cached:
                self.cached[digest] = block_id  # else an identical block is cached: keep that one
                self.block_digests[block_id] = digest

    def _evict(self, block_id: int) -> None:
        digest = self.block_digests[block_id]
        if digest is not None:
            del self.cached[digest]
            self.block_digests[block_id] = None
