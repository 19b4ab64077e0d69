"""The OpenAI-compatible endpoints of `kvpilot serve`, through the official `openai` client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from server_harness import RunningServer, start_server
from transformers import AutoTokenizer

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smol_folder: str) -> Iterator[RunningServer]:
    running = start_server({"max_model_len": 1024, "max_num_seqs": 4}, api_key=API_KEY)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def _post(server: RunningServer, path: str, body: Any = None, content: str | None = None,
          key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60)
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


# ---- answers ---------------------------------------------------------------------------------

def test_chat_completion_answers_greedily_with_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16)
    choice = reply.choices[0]
    assert choice.message.content == "The capital of France is Paris."
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_completion_returns_text_and_usage(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert reply.choices[0].text.startswith(" Paris")
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 4 and reply.usage.prompt_tokens == 5


def test_completion_accepts_token_ids(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4)
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], temperature=0, max_tokens=4)
    assert ids.choices[0].text == text.choices[0].text


def test_several_prompts_are_one_choice_each_in_order(client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    alone = [client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=5) for p in prompts]
    reply = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=5)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [a.choices[0].text for a in alone]
    assert reply.usage is not None and alone[0].usage is not None
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    assert reply.usage.completion_tokens == 15
    ids = client.completions.create(model=MODEL, prompt=[[504, 3575, 282, 4649, 314], [1, 2, 3]], temperature=0,
                                    max_tokens=5)
    assert ids.choices[0].text == alone[0].choices[0].text and len(ids.choices) == 2


def test_several_prompts_with_n_number_the_samples_prompt_by_prompt(client: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "The best fruit is"]
    kwargs: dict[str, Any] = {"model": MODEL, "n": 2, "seed": 5, "max_tokens": 6}
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    expected = {i * 2 + c.index: c.text for i, a in enumerate(alone) for c in a.choices}
    reply = client.completions.create(prompt=prompts, **kwargs)
    assert {c.index: c.text for c in reply.choices} == expected
    streamed = dict.fromkeys(expected, "")
    usage = None
    for chunk in client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                           **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.text
        usage = chunk.usage or usage
    assert streamed == expected
    assert usage is not None and usage.completion_tokens == 4 * 6


@pytest.mark.parametrize(("prompt", "message"), [([], "must not be empty"), (["hi", ""], "empty prompt"),
                                                 (["hi", "hello " * 1100], "maximum context length")])
def test_a_bad_prompt_among_several_refuses_the_request(client: openai.OpenAI, prompt: list[str],
                                                         message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_max_completion_tokens_limits_chat(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_completion_tokens=3)
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert reply.choices[0].finish_reason == "length"


def test_n_samples_are_distinct_choices(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=7, temperature=1.0, max_tokens=6)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert reply.usage is not None and reply.usage.completion_tokens == 12


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    texts = {client.completions.create(model=MODEL, prompt="My favourite food is", seed=3, temperature=1.0,
                                       max_tokens=8).choices[0].text for _ in range(2)}
    assert len(texts) == 1


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16, stop=["Paris"])
    assert reply.choices[0].message.content == "The capital of France is "
    assert reply.choices[0].finish_reason == "stop"


def test_vllm_sampling_fields_are_honoured(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=12,
                                           extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.01,
                                                       "repetition_penalty": 1.1, "min_tokens": 12})
    assert reply.usage is not None and reply.usage.completion_tokens == 12


def test_priority_extra_field_is_accepted_and_typed(server: RunningServer, client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=2,
                                      extra_body={"priority": -3})
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    bad = httpx.post(f"{server.base_url}/v1/completions",
                     json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "priority": "high"})
    assert bad.status_code == 400 and "priority" in bad.text


def test_chat_logprobs_have_top_alternatives(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=5,
                                           logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 5
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy: the top one


def test_completion_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3,
                                      logprobs=2)
    lp = reply.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 3 and len(lp.token_logprobs or []) == 3
    assert "".join(lp.tokens or []) == reply.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs or [])


def test_echo_with_max_tokens_0_scores_the_prompt_as_hf_does(client: openai.OpenAI, smol_folder: str,
                                                            smol_hf: Any) -> None:
    """What log-likelihood evaluations send: the prompt back with each token's logprob under the
    model (the first token's null), nothing generated."""
    prompt = "The capital of France is Paris"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = reply.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == 6
    lp = choice.logprobs
    assert lp is not None and "".join(lp.tokens or []) == prompt
    assert lp.token_logprobs is not None and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(6)]
    ids = AutoTokenizer.from_pretrained(smol_folder)(prompt).input_ids
    with torch.no_grad():
        ref = smol_hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for i in range(1, 6):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-3)
        top = lp.top_logprobs[i]  # the prompt's token and the most likely one
        assert max(top.values()) == pytest.approx(ref[i - 1].max().item(), abs=2e-3)
        assert lp.tokens[i] in top
    # " Paris" after "The capital of France is" is the model's own first choice
    assert lp.token_logprobs[5] == pytest.approx(max(lp.top_logprobs[5].values()))


def test_echo_puts_the_prompt_before_the_completion_and_its_logprobs(client: openai.OpenAI, smol_folder: str) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    lp, base = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert lp is not None and base is not None
    assert len(lp.tokens or []) == 5 + 3
    assert lp.tokens[5:] == base.tokens and lp.token_logprobs[5:] == base.token_logprobs
    assert lp.text_offset[5:] == [o + len(prompt) for o in base.text_offset or []]
    assert echoed.usage is not None and echoed.usage.completion_tokens == 3
    # streamed: the first chunk starts with the prompt; the chunks add up to the same text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                            stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith(prompt) and "".join(texts) == echoed.choices[0].text
    # several prompts, one as token ids: each choice echoes its own prompt
    ids = AutoTokenizer.from_pretrained(smol_folder)(prompt).input_ids
    two = client.completions.create(model=MODEL, prompt=[ids[:2], ids], max_tokens=1, echo=True, temperature=0)
    assert two.choices[0].text.startswith("The capital") and not two.choices[0].text.startswith(prompt)
    assert two.choices[1].text.startswith(prompt) and two.usage is not None and two.usage.prompt_tokens == 7


def test_prompt_logprobs_field_lists_each_prompt_token(server: RunningServer) -> None:
    """vLLM's `prompt_logprobs`: per prompt token, None first, then {token id: logprob, rank, text}."""
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == 5 and entries[0] is None
    for entry in entries[1:]:
        assert 2 <= len(entry) <= 3  # the prompt's token, and the top 2
        assert {e["rank"] for e in entry.values()} >= {1, 2}
        assert all(isinstance(e["decoded_token"], str) and e["logprob"] <= 0 for e in entry.values())
    assert "prompt_logprobs" not in _post(server, "/v1/completions", {**body, "prompt_logprobs": None}).json()["choices"][0]
    error = _error(_post(server, "/v1/completions", {**body, "prompt_logprobs": 21}), 400)
    assert error["param"] == "prompt_logprobs"
    error = _error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 0}), 400)
    assert error["param"] == "max_tokens" and "echo" in error["message"]


# ---- streaming -------------------------------------------------------------------------------

def test_streaming_chat_matches_non_streaming_and_ends_with_usage(client: openai.OpenAI) -> None:
    expected = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16)
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == expected.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_without_usage_option_sends_none(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                            max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith(" Paris")
    assert all(c.usage is None for c in chunks)


def test_streaming_n_keeps_choices_apart(client: openai.OpenAI) -> None:
    expected = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=11, max_tokens=6)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=11, max_tokens=6,
                                           stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in expected.choices}


def test_concurrent_streams_interleave_and_match_non_streaming(server: RunningServer, client: openai.OpenAI) -> None:
    prompts = ["Tell me a story about a cat.", "Name a color.", "What is 2 + 2?", "Write a haiku about rain."]
    kwargs: dict[str, Any] = {"model": MODEL, "temperature": 0.8, "max_tokens": 12}
    expected = [client.chat.completions.create(messages=[{"role": "user", "content": p}], seed=i, **kwargs)
                .choices[0].message.content for i, p in enumerate(prompts)]

    async def stream_one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, float, float]:
        text, first, last = "", 0.0, 0.0
        stream = await aclient.chat.completions.create(messages=[{"role": "user", "content": prompts[i]}],
                                                       seed=i, stream=True, **kwargs)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic()
                last = time.monotonic()
                text += chunk.choices[0].delta.content
        return text, first, last

    async def all_streams() -> list[tuple[str, float, float]]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(stream_one(aclient, i) for i in range(len(prompts))))

    results = asyncio.run(all_streams())
    assert [text for text, _, _ in results] == expected
    # interleaved: every stream had started before any finished
    assert max(first for _, first, _ in results) < min(last for _, _, last in results)


# ---- errors ----------------------------------------------------------------------------------

def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_malformed_json_is_400(server: RunningServer) -> None:
    error = _error(_post(server, "/v1/chat/completions", content='{"messages": [}'), 400)
    assert error["code"] == "invalid_json"


def test_wrong_field_type_is_400_naming_the_field(server: RunningServer) -> None:
    error = _error(_post(server, "/v1/chat/completions", {"messages": FRANCE, "temperature": "hot"}), 400)
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"
    error = _error(_post(server, "/v1/completions", {"prompt": {"text": "hi"}}), 400)
    assert error["param"].startswith("prompt")


def test_missing_required_field_is_400(server: RunningServer) -> None:
    assert _error(_post(server, "/v1/chat/completions", {"model": MODEL}), 400)["param"] == "messages"


def test_out_of_range_sampling_value_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=0)
    assert info.value.status_code == 400 and "max_tokens" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="hi", top_p=1.5)


def test_prompt_over_max_model_len_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello " * 1100, max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    assert "1024" in info.value.message


def test_empty_prompt_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model=MODEL, prompt="", max_tokens=1)


def test_bad_or_missing_api_key_is_401(server: RunningServer) -> None:
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1)
    assert _error(_post(server, "/v1/completions", {"prompt": "hi"}, key=None), 401)["code"] == "invalid_api_key"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=FRANCE, max_tokens=1)
    assert info.value.code == "model_not_found"


def test_unknown_route_is_404_in_openai_shape(server: RunningServer) -> None:
    _error(httpx.get(f"{server.base_url}/v1/nothing-here"), 404)


def test_admin_endpoints_are_disabled_without_a_token(server: RunningServer) -> None:
    _error(httpx.get(f"{server.base_url}/admin/config", headers={"Authorization": "Bearer x"}), 404)
