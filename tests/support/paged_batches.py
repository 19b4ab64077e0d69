"""Random paged-attention batches and an independent float64 dense attention, shared by the
kernel tests (Triton and the CPU kernels)."""

from __future__ import annotations

import torch

# (context length, new tokens) per sequence
DECODE = [(37, 1), (5, 1), (64, 1), (1, 1)]
MIXED = [(37, 5), (20, 1), (19, 19), (70, 1), (33, 16)]

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_batch(
    specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: torch.device | str, poison_unused: bool = False,
) -> Batch:
    """Random q and caches; each sequence's blocks are drawn in random order from a shuffled pool
    with spare blocks. With poison_unused, every cache slot outside a context is NaN."""
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in specs]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks)
    tables = torch.full((len(specs), max(max(blocks_per_seq), 1) + 1), num_blocks - 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = pool[used:used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    if poison_unused:
        live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for i, (ctx, _) in enumerate(specs):
            slots = tables[i, :blocks_per_seq[i]].long()[:, None] * block_size + torch.arange(block_size)
            live[slots.flatten()[:ctx]] = True
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[~live] = float("nan")
    num_tokens = sum(q_len for _, q_len in specs)
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype)
    qsl = torch.tensor([0] + [q_len for _, q_len in specs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor([ctx for ctx, _ in specs], dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, tables, seq_lens, qsl))  # type: ignore[return-value]


def dense_float64(batch: Batch, scale: float) -> torch.Tensor:
    """Per-sequence dense causal attention in float64, written independently of the reference."""
    q, k_cache, v_cache, tables, seq_lens, qsl = (t.cpu() for t in batch)
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, ctx in enumerate(seq_lens.tolist()):
        rows = range(qsl[i].item(), qsl[i + 1].item())
        slots = torch.arange(ctx)
        blocks = tables[i].long()[slots // k_cache.shape[1]]
        k = k_cache[blocks, slots % k_cache.shape[1]].double().repeat_interleave(group, 1)  # (ctx, H, D)
        v = v_cache[blocks, slots % k_cache.shape[1]].double().repeat_interleave(group, 1)
        for r, row in enumerate(rows):
            pos = ctx - len(rows) + r
            s = torch.einsum("hd,nhd->hn", q[row].double(), k[:pos + 1]) * scale
            out[row] = torch.einsum("hn,nhd->hd", s.softmax(-1), v[:pos + 1])
    return out
