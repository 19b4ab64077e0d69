"""Sequence ids belong to an engine: two engines in one process number their sequences each from
zero, so per-sequence state keyed by id (the runner's seeded generators) never depends on what
another engine did."""

from __future__ import annotations

from kvpilot.runtime import LLM, SamplingParams


def test_each_engine_numbers_its_own_sequences(tiny_models) -> None:
    folder, _ = tiny_models["llama"]
    first, second = LLM(folder, max_model_len=64), LLM(folder, max_model_len=64)
    a = first.engine.add_request("a", [1, 2, 3], SamplingParams(n=2, max_tokens=1))
    b = second.engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=1))
    c = first.engine.add_request("c", [4, 5], SamplingParams(max_tokens=1))
    assert [s.seq_id for s in a.seqs] == [0, 1]
    assert [s.seq_id for s in b.seqs] == [0]
    assert [s.seq_id for s in c.seqs] == [2]
