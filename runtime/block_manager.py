"""Block bookkeeping for the paged KV cache. No torch: plain counting, tested on its own.

The KV cache is `num_blocks` blocks of `block_size` token slots. A sequence holds the blocks in
its `block_table`, in order: token position p lives in slot `block_table[p // block_size] *
block_size + p % block_size`. Blocks carry reference counts so that a later prefix cache can
share one block between sequences; a block returns to the free pool when its count reaches zero.
"""

from __future__ import annotations

from collections import deque

from kvpilot.runtime.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, not {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

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
        for _ in range(self.num_new_blocks(seq, num_new_tokens)):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks; unshared ones go back to the pool."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []
