"""Random paged-attention batches, an independent float64 dense attention and the comparisons
the kernel tests share (Triton and the CPU kernels)."""

from __future__ import annotations

import torch

from kvpilot.kernels.kv_quant import quantize
from kvpilot.kernels.reference import kv_cache_empty
from kvpilot.kernels.step_plan import StepPlan

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


def step_plan(batch: Batch, max_query_len: int | None = None) -> StepPlan:
    """The plan of a step holding only `batch`'s attention (no cache writes, positions 0)."""
    q, k_cache, _, tables, seq_lens, qsl = batch
    num_tokens = q.shape[0]
    return StepPlan(
        positions=torch.zeros(num_tokens, dtype=torch.long, device=q.device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=q.device),
        block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
        max_query_len=int(qsl.diff().max()) if max_query_len is None else max_query_len,
        cos_sin_cache=torch.zeros(1, q.shape[2], device=q.device), block_size=k_cache.shape[1],
    )


def head_major_copy(cache: torch.Tensor) -> torch.Tensor:
    """The same cache stored head-major (each (block, KV head) one contiguous run), as the GPU
    engine allocates it."""
    hm = kv_cache_empty(*cache.shape, head_major=True, dtype=cache.dtype, device=cache.device)
    hm.copy_(cache)
    assert hm.stride(1) == cache.shape[3] and not hm.is_contiguous()
    return hm


def head_major_batch(batch: Batch) -> Batch:
    q, k_cache, v_cache, *rest = batch
    return (q, head_major_copy(k_cache), head_major_copy(v_cache), *rest)  # type: ignore[return-value]


def fp8_batch(batch: Batch, k_scale: float, v_scale: float) -> tuple[Batch, torch.Tensor]:
    """`batch` with its caches quantised to FP8 (same layout) and their kv_scales."""
    q, k_cache, v_cache, *rest = batch
    scales = torch.tensor([k_scale, v_scale], dtype=torch.float32, device=q.device)
    caches = []
    for cache, scale in ((k_cache, scales[0]), (v_cache, scales[1])):
        fp8 = kv_cache_empty(*cache.shape, head_major=cache.stride(1) != cache[0, 0].numel(),
                             dtype=torch.float8_e4m3fn, device=cache.device)
        fp8.copy_(quantize(cache, scale))
        caches.append(fp8)
    return (q, *caches, *rest), scales  # type: ignore[return-value]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output holds NaN (an element was not written or read garbage)"
    return ((out.double() - ref.double().to(out.device)).norm() / ref.double().norm()).item()


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32:
        return 1e-5 if device.type == "cpu" else 2e-3  # tf32 dots on the GPU
    return 3e-3 if dtype == torch.float16 else 1.5e-2


def max_query_len(batch: Batch) -> int:
    return int(batch[5].diff().max())


def run_triton(batch: Batch, scale: float, hint: bool = False, **kwargs: object) -> torch.Tensor:
    """The Triton kernels into a NaN-poisoned output; hint passes max_query_len as the engine
    does (without it an all-decode batch runs the decode kernel that loops over any q_len)."""
    # imported here: it imports triton, which only the kernel tests need
    from kvpilot.kernels.paged_attention import paged_attention_with

    poisoned = torch.full_like(batch[0], float("nan"))
    if hint:
        kwargs["max_query_len"] = max_query_len(batch)
    return paged_attention_with(*batch, scale, out=poisoned, **kwargs)  # type: ignore[arg-type]
