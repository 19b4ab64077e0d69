"""The step plan: its index work is done once per step, by the first layer that needs it, and
shared by the others; a new step's plan does it again for the new tensors."""

from __future__ import annotations

import pytest
import torch
from paged_batches import MIXED, make_batch, rel_err

from kvpilot.kernels import reference, step_plan
from kvpilot.kernels.reference import ReferenceOps
from kvpilot.kernels.step_plan import StepPlan

NUM_LAYERS = 3


def test_index_work_is_done_once_per_step_not_once_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("plan_write", "plan_attention", "plan_rotary"):
        real = getattr(step_plan, name)
        monkeypatch.setattr(step_plan, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    ops = ReferenceOps()
    for step in range(2):
        q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(MIXED[step:], 4, 2, 16, 8, torch.float32, "cpu")
        n = q.shape[0]
        plan = StepPlan(torch.arange(n), torch.arange(n), tables, seq_lens, qsl, int(qsl.diff().max()),
                        torch.randn(200, 16), 8)
        for _ in range(NUM_LAYERS):
            q_layer, k = q.clone(), torch.randn(n, 2, 16)
            ops.rotary_embedding(q_layer, k, plan)
            ops.write_kv_cache(k, k, k_cache, v_cache, plan)
            out = ops.paged_attention(q_layer, k_cache, v_cache, plan, 0.25)
            expected = reference.paged_attention(q_layer, k_cache, v_cache, tables, seq_lens, qsl, 0.25)
            assert rel_err(out, expected) == 0.0
        assert sorted(calls) == ["plan_attention", "plan_rotary", "plan_write"], step
        calls.clear()
