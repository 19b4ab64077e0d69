"""Plain-torch reference ops: the CPU path of the engine and the specification the Triton
kernels are tested against.

Layouts (shared with `kvpilot.kernels.triton_ops`; `ops.py` documents the contract):
  q, out        (num_tokens, num_heads, head_dim)            varlen batch, sequences back to back
  k_cache/v_cache (num_blocks, block_size, num_kv_heads, head_dim)
  block_tables  (num_seqs, max_blocks) int32                  block ids of each sequence, in order
  seq_lens      (num_seqs,) int32      context length per sequence, new tokens included
  query_start_loc (num_seqs + 1,) int32 cumulative query lengths; sequence i owns rows
                qsl[i]:qsl[i+1] of q, which are its last (qsl[i+1]-qsl[i]) context positions
  slot_mapping  (num_tokens,) int64    flat slot (block_id * block_size + offset); -1 = skip
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' keys and values into their cache slots, in place."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    # (block, offset) indexing works for any physical layout (see `kv_cache_empty`)
    k_cache[slots // block_size, slots % block_size] = k[valid]
    v_cache[slots // block_size, slots % block_size] = v[valid]


def kv_cache_empty(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                   head_major: bool, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed cache of the contract's shape (num_blocks, block_size, num_kv_heads, head_dim).

    head_major stores it as (num_blocks, num_kv_heads, block_size, head_dim) and returns the
    transposed view: each (block, KV head) is then one contiguous run of block_size * head_dim
    elements instead of block_size rows of head_dim scattered num_kv_heads rows apart. Every op
    takes either (they use strides); the GPU engine allocates head-major (benchmarks/RESULTS.md).
    """
    if not head_major:
        return torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device).transpose(1, 2)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """(length, num_kv_heads, head_dim) of one sequence, gathered from its blocks."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

    Decode sequences (one new token) are batched into one padded call; sequences with several
    new tokens (prefill, chunked prefill) are computed one by one.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    gqa = num_heads != num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decode:
        all_decode = len(decode) == len(lens) == num_tokens
        ctx = [lens[i] for i in decode]
        max_len = max(ctx)
        block_size = k_cache.shape[1]
        nb = -(-max_len // block_size)
        table = (block_tables if all_decode else block_tables[decode])[:, :nb].long().flatten()
        # index_select on the block dim: one contiguous copy of each sequence's blocks
        k = k_cache.index_select(0, table).view(len(decode), nb * block_size, num_kv_heads, head_dim)[:, :max_len]
        v = v_cache.index_select(0, table).view(len(decode), nb * block_size, num_kv_heads, head_dim)[:, :max_len]
        mask = torch.arange(max_len, device=q.device)[None, :] < torch.tensor(ctx, device=q.device)[:, None]
        rows = None if all_decode else torch.tensor([starts[i] for i in decode], device=q.device)
        o = F.scaled_dot_product_attention(
            (q if rows is None else q[rows]).unsqueeze(2),  # (B, H, 1, D)
            k.transpose(1, 2), v.transpose(1, 2),  # (B, Hk, L, D)
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa,
        ).squeeze(2)
        if rows is None:
            return o
        out[rows] = o
    for i in range(len(lens)):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1 or q_len == 0:
            continue
        length = lens[i]
        k = _gather_context(k_cache, block_tables[i], length)
        v = _gather_context(v_cache, block_tables[i], length)
        # query row r sits at context position length - q_len + r and sees keys 0..that position
        pos = torch.arange(length - q_len, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(
            q[starts[i]:starts[i + 1]].transpose(0, 1),  # (H, q_len, D)
            k.transpose(0, 1), v.transpose(0, 1),  # (Hk, length, D)
            attn_mask=mask, scale=scale, enable_gqa=gqa,
        )
        out[starts[i]:starts[i + 1]] = o.transpose(0, 1)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (num_tokens, hidden) -> normalised copy, computed in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight."""
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q (T, Hq, D) and k (T, Hk, D) in place, GPT-NeoX style (halves, as HF Llama).

    cos_sin_cache (max_position, D) holds cos in [:, :D/2] and sin in [:, D/2:], float32; the
    llama3 frequency scaling is baked into it by the model, so the op is the same for both.
    """
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    for t in (q, k):
        x1 = t[..., :half].float()
        x2 = t[..., half:].float()
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        t[..., :half] = r1.to(t.dtype)
        t[..., half:] = r2.to(t.dtype)
