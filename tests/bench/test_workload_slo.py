"""The benchmarks' inputs: random prompts, JSONL and ShareGPT datasets, arrival times and `--slo`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvpilot.bench.loadgen import RequestResult, arrival_times
from kvpilot.bench.slo import Slo, parse_slo
from kvpilot.bench.summary import summarize
from kvpilot.bench.workload import RandomSpec, WorkloadError, load_dataset, random_requests


def test_random_prompts_share_the_prefix_and_keep_their_lengths_in_range() -> None:
    requests = random_requests(RandomSpec(200, 100, 50, range_ratio=0.2, prefix_len=8), seed=3)
    prefixes = {tuple(r.prompt[:8]) for r in requests}  # type: ignore[index]
    assert len(prefixes) == 1
    assert all(8 + 80 <= r.prompt_len <= 8 + 120 and r.prompt_len == len(r.prompt) for r in requests)  # type: ignore[operator,arg-type]
    assert all(40 <= r.output_len <= 60 for r in requests)
    assert len({r.prompt_len for r in requests}) > 10
    assert all(100 <= t < 256 for r in requests for t in r.prompt)  # type: ignore[union-attr]
    assert random_requests(RandomSpec(5, 10, 5), seed=1) == random_requests(RandomSpec(5, 10, 5), seed=1)


def test_a_dataset_cycles_and_takes_its_output_lengths(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "output_len": 7}\n\n{"prompt_token_ids": [1, 2, 3]}\n')
    requests = load_dataset(path, 3, default_output_len=4)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in requests] == [("a", None, 7), ([1, 2, 3], 3, 4), ("a", None, 7)]


@pytest.mark.parametrize(("line", "message"), [
    ("[1, 2]", "line 2: expected an object"),
    ('{"prompt": ""}', "line 2: expected a non-empty 'prompt'"),
    ('{"prompt": "x", "output_len": 0}', "line 2: output_len must be a positive integer"),
    ('{"prompt_token_ids": ["a"]}', "line 2: prompt_token_ids must be"),
    ("{nope", "line 2: not JSON"),
])
def test_a_bad_dataset_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=message):
        load_dataset(path, 2, 4)


def sharegpt(*pairs: tuple[str, str], extra: list[object] | None = None) -> str:
    """A ShareGPT file's text: one conversation per (prompt, reply), a third turn on each."""
    conversations = [{"id": str(i), "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply},
                                                      {"from": "human", "value": "and then?"}]}
                     for i, (prompt, reply) in enumerate(pairs)]
    return json.dumps(conversations + (extra or []), indent=2)


def words(text: str) -> list[int]:
    """A stand-in tokenizer for the sampling rules: one token a word."""
    return [len(w) for w in text.split()]


def test_sharegpt_is_sampled_as_vllm_samples_it(tmp_path: Path) -> None:
    ok = [(f"this is prompt {i} " + "w " * i, "reply " * (4 + i)) for i in range(6)]  # 4..9 tokens each side
    passed_over = [("too short", "a reply of five words"), ("four words of prompt", "tiny"),
                   ("w " * 1025, "long prompt over here"), ("w " * 1000, "w " * 1049)]
    path = tmp_path / "sharegpt.json"
    path.write_text(sharegpt(*ok, *passed_over, extra=[{"id": "x", "conversations": [{"from": "human", "value": "alone"}]}]))
    requests = load_dataset(path, 6, default_output_len=99, seed=1, encode=words)
    replies = {prompt: len(words(reply)) for prompt, reply in ok}
    assert sorted(r.prompt for r in requests) == sorted(replies)  # type: ignore[type-var]
    assert all(r.output_len == replies[r.prompt] and r.prompt_len is None for r in requests)  # type: ignore[index]
    # the seed orders them (as vLLM shuffles the file), the same seed the same order; fewer cycle
    again = load_dataset(path, 6, 99, seed=1, encode=words)
    other = load_dataset(path, 6, 99, seed=2, encode=words)
    assert again == requests and [r.prompt for r in other] != [r.prompt for r in requests]
    assert load_dataset(path, 8, 99, seed=1, encode=words)[6:] == requests[:2]


@pytest.mark.parametrize(("text", "encode", "message"), [
    (sharegpt(("a prompt of words", "and a reply of words")), None, "is ShareGPT JSON: .* needs --tokenizer"),
    ('[{"prompt": "x"}]', words, "not ShareGPT's: each entry needs a 'conversations' list"),
    (sharegpt(("one", "two")), words, "none of its 1 conversations is within the sampling limits"),
    ("[]", words, "holds no requests"),
    ('[{"conversations": []}', words, "not JSON"),
])
def test_a_bad_sharegpt_file_is_named(tmp_path: Path, text: str, encode, message: str) -> None:
    path = tmp_path / "d.json"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message):
        load_dataset(path, 2, 4, encode=encode)


def test_poisson_arrivals_have_the_rate_and_bursty_ones_bunch() -> None:
    rng = np.random.default_rng(0)
    poisson = arrival_times(20000, 10.0, 1.0, rng)
    assert poisson[0] == 0 and np.all(np.diff(poisson) >= 0)
    assert 20000 / poisson[-1] == pytest.approx(10.0, rel=0.03)
    bursty = np.diff(arrival_times(20000, 10.0, 0.25, rng))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.std() > 1.5 * np.diff(poisson).std()
    assert np.all(arrival_times(5, float("inf"), 1.0, rng) == 0)


def test_slo_parsing() -> None:
    assert parse_slo("ttft=500ms,itl=50ms") == Slo(ttft_s=0.5, itl_s=0.05)
    assert parse_slo("e2e=2s").limits() == {"e2e": 2.0}
    for bad, message in (("ttft=500", "unit"), ("tpot=1s", "KEY=VALUE"), ("ttft=1s,ttft=2s", "twice"),
                         ("ttft=0ms", "positive"), ("", "KEY=VALUE")):
        with pytest.raises(ValueError, match=message):
            parse_slo(bad)


def test_goodput_counts_requests_within_every_limit() -> None:
    def done(ttft: float, itls: list[float]) -> RequestResult:
        return RequestResult(0.0, 10, len(itls) + 1, ttft, itls, ttft + sum(itls))

    results = [done(0.1, [0.01, 0.01]), done(0.6, [0.01]), done(0.1, [0.2, 0.01]),
               RequestResult(0.0, 10, error="HTTP 500: boom")]
    summary = summarize(results, duration_s=2.0, request_rate=2.0, slo=parse_slo("ttft=500ms,itl=50ms"))
    assert summary["goodput"] == 0.5 and summary["slo_attainment"] == 0.25
    assert summary["completed"] == 3 and summary["errors"] == {"HTTP 500: boom": 1} and not summary["meets_slo"]
    assert summary["request_throughput"] == 1.5 and summary["total_output_tokens"] == 3 + 2 + 3
