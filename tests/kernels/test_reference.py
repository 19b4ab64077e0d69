"""The reference: float64 dense attention is what it computes, and the engine's way of calling
it (ReferenceOps with a step plan) gives what its tensor functions give."""

from __future__ import annotations

import pytest
import torch
from paged_batches import DECODE, MIXED, dense_float64, make_batch, rel_err, step_plan

from kvpilot.kernels import reference
from kvpilot.kernels.reference import ReferenceOps
from kvpilot.kernels.step_plan import StepPlan


@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_reference_equals_float64_dense(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch(specs, num_heads, num_kv_heads, 64, 16, torch.float32, "cpu")
    out = reference.paged_attention(*batch, 0.125)
    assert rel_err(out, dense_float64(batch, 0.125)) < 1e-5


def test_ops_with_a_step_plan_equal_the_tensor_functions() -> None:
    """A mixed step through every layer op: rotary, cache write (one padding slot), attention."""
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(MIXED, 8, 2, 64, 16, torch.float32, "cpu")
    num_tokens = q.shape[0]
    k, v = torch.randn(num_tokens, 2, 64), torch.randn(num_tokens, 2, 64)
    positions = torch.randint(0, 60, (num_tokens,))
    slots = torch.randperm(k_cache.shape[0] * 16)[:num_tokens]
    slots[3] = -1
    cos_sin = torch.randn(64, 64)
    plan = StepPlan(positions, slots, tables, seq_lens, qsl, int(qsl.diff().max()), cos_sin, 16)
    ops, caches = ReferenceOps(), (k_cache.clone(), v_cache.clone())
    q2, k2 = q.clone(), k.clone()
    ops.rotary_embedding(q2, k2, plan)
    ops.write_kv_cache(k2, v, *caches, plan)
    got = ops.paged_attention(q2, *caches, plan, 0.125)
    reference.rotary_embedding(positions, q, k, cos_sin)
    reference.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(q2, q) and torch.equal(k2, k)
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)
    assert torch.equal(got, reference.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125))


def test_a_cache_of_another_block_size_than_planned_is_refused() -> None:
    batch = make_batch(DECODE, 4, 2, 64, 16, torch.float32, "cpu")
    plan = step_plan(batch)
    other = make_batch(DECODE, 4, 2, 64, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="planned for block_size 16, but the cache has 8-token blocks"):
        ReferenceOps().paged_attention(other[0], other[1], other[2], plan, 0.125)
