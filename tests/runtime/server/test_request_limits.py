"""Requests the engine could never serve, or that OpenAI and vLLM refuse, get a 400 that names the
limit, through the real server and the official `openai` client; and `/metrics` carries no
`*_created` series."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from server_harness import RunningServer, start_server

from kvpilot.runtime.server.protocol import MAX_PROMPTS

MODEL = "SmolLM2-135M-Instruct"
ADMIN = "admin-token"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(smol_folder: str) -> Iterator[RunningServer]:
    running = start_server({"max_model_len": 256, "max_num_seqs": 4}, admin_token=ADMIN)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_n_beyond_max_num_seqs_is_400_naming_the_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, n=10000, max_tokens=1)
    assert info.value.status_code == 400
    assert info.value.param == "n" and "max_num_seqs (4)" in info.value.message


def test_best_of_beyond_max_num_seqs_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"max_num_seqs \(4\)"):
        client.completions.create(model=MODEL, prompt="Hi", n=5, best_of=5, max_tokens=1)


def test_n_at_max_num_seqs_is_served(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Hi", n=4, max_tokens=2, seed=1)
    assert len(reply.choices) == 4


def test_the_n_limit_follows_a_live_max_num_seqs_change(server: RunningServer, client: openai.OpenAI) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    answer = httpx.post(f"{server.base_url}/admin/config", json={"max_num_seqs": 8}, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    try:
        assert len(client.completions.create(model=MODEL, prompt="Hi", n=6, max_tokens=1, seed=1).choices) == 6
        with pytest.raises(openai.BadRequestError, match=r"max_num_seqs \(8\)"):
            client.completions.create(model=MODEL, prompt="Hi", n=9, max_tokens=1)
    finally:
        httpx.post(f"{server.base_url}/admin/config", json={"max_num_seqs": 4}, headers=headers, timeout=60)


def test_a_prompt_list_is_bounded_without_a_queue_limit(server: RunningServer) -> None:
    """This server runs without --max-queue-len, as by default: a list of prompts is still capped."""
    assert server.state.config.max_queue_len is None
    url = f"{server.base_url}/v1/completions"
    too_many = httpx.post(url, json={"model": MODEL, "prompt": ["Hi"] * (MAX_PROMPTS + 1), "max_tokens": 1}, timeout=60)
    assert too_many.status_code == 400, too_many.text
    error = too_many.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "invalid_value"
    assert f"at most {MAX_PROMPTS}" in error["message"]
    ids = httpx.post(url, json={"model": MODEL, "prompt": [[1, 2]] * 200_000, "max_tokens": 1}, timeout=60)
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"
    # a list of token ids is one prompt, however long: the context bounds it, not the prompt cap
    long_ids = httpx.post(url, json={"model": MODEL, "prompt": [1] * (MAX_PROMPTS + 1), "max_tokens": 1}, timeout=60)
    assert long_ids.json()["error"]["code"] == "context_length_exceeded", long_ids.text
    assert server.health()["pending_requests"] == 0


def test_max_tokens_beyond_the_context_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=100000)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert "256 tokens" in info.value.message and "100005" in info.value.message
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=250)


def test_max_tokens_that_just_fits_is_served(client: openai.OpenAI) -> None:
    # 251 tokens on a CPU that CI shares: more time than the client's default
    reply = client.with_options(timeout=300).completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=251,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 251


def test_user_message_with_null_content_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": None}], max_tokens=1)  # type: ignore[misc,list-item]
    assert info.value.param == "messages" and "user message needs content" in info.value.message


def test_assistant_message_with_null_content_is_accepted(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "Hello?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert reply.choices[0].message.content is not None


def test_stream_options_without_stream_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, stream_options={"include_usage": True})
    assert info.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, stream=False,
                                  stream_options={"include_usage": True})


def test_metrics_carry_no_created_series(server: RunningServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    page = httpx.get(f"{server.base_url}/metrics").text
    assert "vllm:num_preemptions_total" in page and "vllm:e2e_request_latency_seconds_count" in page
    assert [line for line in page.splitlines() if "_created" in line] == []


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tools"),
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
])
def test_what_the_server_cannot_honour_is_400_not_ignored(client: openai.OpenAI, extra: dict[str, object],
                                                          param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, **extra)  # type: ignore[call-overload]
    assert info.value.param == param and "not supported" in info.value.message


def test_what_asks_for_nothing_more_than_text_is_served(client: openai.OpenAI) -> None:
    for extra in ({"tools": [TOOL], "tool_choice": "none"}, {"response_format": {"type": "text"}},
                  {"logit_bias": {}}):
        reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **extra)  # type: ignore[call-overload]
        assert reply.choices[0].message.content is not None and not reply.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logit_bias={"1": 5})
