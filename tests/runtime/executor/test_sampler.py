"""The sampler on fixed logits: each filter keeps exactly the tokens it should, and sampling
follows the filtered distribution."""

from __future__ import annotations

import torch

from kvpilot.runtime.executor.inputs import SamplingRow
from kvpilot.runtime.executor.sampler import sample
from kvpilot.runtime.sampling_params import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def draw(params: SamplingParams, n: int = 4000, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    row = SamplingRow(seq_id=0, params=params, token_ids=[0], num_prompt_tokens=1, eos_token_ids=frozenset())
    counts = torch.zeros(LOGITS.shape[1])
    for _ in range(n):
        counts[sample(LOGITS.clone(), [row], [gen]).token_ids[0]] += 1
    return counts / n


def test_temperature_one_follows_the_distribution() -> None:
    freq = draw(SamplingParams(temperature=1.0))
    assert torch.allclose(freq, LOGITS.exp()[0], atol=0.03)


def test_top_k_keeps_the_k_most_likely() -> None:
    freq = draw(SamplingParams(temperature=1.0, top_k=2))
    assert freq[2:].sum() == 0
    assert abs(freq[0].item() - 2 / 3) < 0.03


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    freq = draw(SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.25 < 0.8 <= 0.9
    assert (freq[:3] > 0).all() and freq[3:].sum() == 0


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    freq = draw(SamplingParams(temperature=1.0, min_p=0.2))  # threshold 0.1
    assert (freq[:3] > 0).all() and freq[3:].sum() == 0


def test_low_temperature_sharpens() -> None:
    assert draw(SamplingParams(temperature=0.1), n=500)[0] > 0.99


def test_greedy_and_logprobs_of_the_raw_distribution() -> None:
    row = SamplingRow(seq_id=0, params=SamplingParams(temperature=0, logprobs=2, repetition_penalty=5.0),
                      token_ids=[0], num_prompt_tokens=1, eos_token_ids=frozenset())
    result = sample(LOGITS.clone(), [row])
    assert result.token_ids == [1]  # the penalty on token 0 (seen in the prompt) flips the argmax
    value, rank, top = result.logprobs[0]
    assert abs(value - LOGITS[0, 1].item()) < 1e-6 and rank == 2  # logprobs ignore the penalty
    assert [t for t, _ in top] == [0, 1]


def _reference_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, int, list[tuple[int, float]]]:
    lp = logits.log_softmax(dim=-1)
    rank = int((lp > lp[token]).sum()) + 1
    vals, ids = lp.topk(k) if k else (torch.tensor([]), torch.tensor([], dtype=torch.long))
    return float(lp[token]), rank, list(zip(ids.tolist(), vals.tolist(), strict=True))


def test_a_mixed_batch_takes_one_host_copy_and_matches_per_row_results(monkeypatch) -> None:
    from kvpilot.runtime.executor import sampler

    copies = []
    real = sampler.to_host
    monkeypatch.setattr(sampler, "to_host", lambda t: copies.append(t.shape) or real(t))
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    asks = [None, 0, 3, None, 7]
    rows = [SamplingRow(seq_id=i, params=SamplingParams(temperature=0 if i % 2 else 0.9, logprobs=a, min_p=0.01 * (i == 4)),
                        token_ids=[1], num_prompt_tokens=1, eos_token_ids=frozenset()) for i, a in enumerate(asks)]
    generators = [torch.Generator().manual_seed(i) for i in range(len(rows))]
    result = sample(logits.clone(), rows, generators)
    assert len(copies) == 1
    for i, ask in enumerate(asks):
        token = result.token_ids[i]
        if i % 2:
            assert token == int(logits[i].argmax())
        if ask is None:
            assert result.logprobs[i] is None
            continue
        value, rank, top = result.logprobs[i]
        ref_value, ref_rank, ref_top = _reference_logprobs(logits[i], token, ask)
        assert abs(value - ref_value) < 1e-6 and rank == ref_rank
        assert [t for t, _ in top] == [t for t, _ in ref_top]
        assert all(abs(v - rv) < 1e-6 for (_, v), (_, rv) in zip(top, ref_top, strict=True))
    copies.clear()
    sample(logits.clone(), [rows[0], rows[3]])  # no logprobs asked: the tokens alone
    assert len(copies) == 1


def test_logits_in_the_model_dtype_sample_as_their_float32_widening() -> None:
    """The runner hands over bf16/fp16 logits: greedy rows take the argmax there, the rest widen to
    float32 first, so every row samples exactly what the float32 logits give (ties included)."""
    torch.manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16):
        logits = (torch.randn(6, 500) * 4).to(dtype)
        logits[0, 7] = logits[0, 300] = logits[0].max() + 1  # a tie: the first index wins either way
        params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=3),
                  SamplingParams(temperature=0.8, top_k=20, seed=5), SamplingParams(temperature=1.2, top_p=0.9),
                  SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5),
                  SamplingParams(temperature=0.7, min_p=0.05, logprobs=2)]
        rows = [SamplingRow(seq_id=i, params=p, token_ids=[3, 7, 9], num_prompt_tokens=1, eos_token_ids=frozenset())
                for i, p in enumerate(params)]
        narrow = logits.clone()
        got = sample(narrow, rows, [torch.Generator().manual_seed(i) for i in range(len(rows))])
        want = sample(logits.float(), rows, [torch.Generator().manual_seed(i) for i in range(len(rows))])
        assert got == want, dtype
        assert got.token_ids[0] == 7
        assert torch.equal(narrow, logits)  # penalties work on a copy
