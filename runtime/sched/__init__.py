"""The engine's bookkeeping, with no torch: requests and sequences, the scheduler and its policies, the block manager, the swap space's blocks and the plan of a block-size change."""
