"""One request cannot crash, stall or leak `kvpilot serve`: each of the hostile requests that once
took the server down gets its clear answer while the engine core lives on, nothing stays
pending, and meanwhile `/health` and a small chat answer come within a second. One server (the
embedded SmolLM2) for the whole module; a hypothesis test throws random JSON at every field."""

from __future__ import annotations

import gc
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import RunningServer, start_server

from kvpilot.runtime.outputs import RequestOutput

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Hi"}]
BODY_LIMIT = 1 << 20
# What /health and a one-token chat may take while a hostile request is served: a second, or, on a
# machine slower than that allows (a loaded one), five times what they take just before it is sent
MEANWHILE_S = 1.0
# 5000**3 empty iterations: days on any machine (two loops can finish within the time limit on a fast one)
NESTED_LOOPS = ("{% for i in range(5000) %}{% for j in range(5000) %}{% for k in range(5000) %}{% endfor %}"
                "{% endfor %}{% endfor %}{{ 'x' }}")


@pytest.fixture(scope="module")
def server(smol_folder: str) -> Iterator[RunningServer]:
    running = start_server({"max_model_len": 256, "max_num_seqs": 72}, max_queue_len=8,
                           max_request_body_bytes=BODY_LIMIT, header_read_timeout=1.0)
    # the first requests pay one-time costs (the first prefill, the tokenizer's thread): not timed
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        assert httpx.post(f"{running.base_url}{path}", json=body, timeout=120).status_code == 200
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


EMITTED_CODES: set[str] = set()  # every error `code` this module's requests were answered with


def _post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """`body` as JSON the way Python writes it (NaN and Infinity included), or raw bytes."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    if response.status_code >= 400:
        EMITTED_CODES.add(response.json()["error"]["code"])
    return response


def _health_and_chat(http: httpx.Client) -> tuple[float, float]:
    """Seconds a `/health` and a one-token chat take, each checked to answer 200."""
    t0 = time.monotonic()
    health = http.get("/health")
    t1 = time.monotonic()
    chat = _post(http, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 1})
    t2 = time.monotonic()
    assert health.status_code == 200, health.text
    assert chat.status_code == 200, chat.text
    return t1 - t0, t2 - t1


def _served_meanwhile(server: RunningServer, http: httpx.Client, hostile: Callable[[], httpx.Response]) -> httpx.Response:
    """Send `hostile` from another thread; while it is in flight, `/health` and a one-token chat
    must answer about as fast as before it (within `MEANWHILE_S`, or five times the slower of two
    timings just before). Afterwards the core lives and nothing is pending."""
    before = [_health_and_chat(http) for _ in range(2)]
    limits = [max(MEANWHILE_S, 5 * max(t[i] for t in before)) for i in (0, 1)]
    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.append(hostile()))
    thread.start()
    started = time.monotonic()
    while True:
        health_s, chat_s = _health_and_chat(http)
        assert health_s < limits[0], f"/health took {health_s:.2f} s (limit {limits[0]:.2f} s)"
        assert chat_s < limits[1], f"a one-token chat took {chat_s:.2f} s (limit {limits[1]:.2f} s)"
        if not thread.is_alive() or time.monotonic() - started > 30:
            break
    thread.join(timeout=60)
    assert result, "the hostile request got no answer"
    server.wait_until(lambda: server.health()["pending_requests"] == 0, timeout=30, what="nothing pending")
    assert server.state.engine.is_alive
    return result[0]


def _error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> str:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return str(error["message"])


COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 2}


# (what, endpoint, body, status, param, code) -- the table and its lesser findings
ROWS = [
    ("stop token past the vocabulary", "/v1/completions",
     {**COMPLETION, "min_tokens": 2, "stop_token_ids": [1_000_000]}, 400, "stop_token_ids", "invalid_value"),
    ("seed + n past the generator", "/v1/completions", {**COMPLETION, "n": 2, "seed": 2**64 - 1},
     400, "seed", "invalid_value"),
    ("top_k past int64", "/v1/chat/completions", {**CHAT, "top_k": 2**63}, 400, "top_k", "invalid_value"),
    ("top_k past the vocabulary", "/v1/chat/completions", {**CHAT, "top_k": 49_153}, 400, "top_k", "invalid_value"),
    ("stop token id 2**64 - 1", "/v1/completions", {**COMPLETION, "min_tokens": 1, "stop_token_ids": [2**64 - 1]},
     400, "stop_token_ids", "invalid_value"),
    ("seed 2**70", "/v1/completions", {**COMPLETION, "seed": 2**70}, 400, "seed", "invalid_value"),
    ("prompt token id 2**70", "/v1/completions", {**COMPLETION, "prompt": [1, 2**70]}, 400, "prompt", "invalid_prompt"),
    ("priority 2**70", "/v1/completions", {**COMPLETION, "priority": 2**70}, 400, "priority", "invalid_value"),
    ("10,000 prompts", "/v1/completions", {**COMPLETION, "prompt": ["hi"] * 10_000}, 400, "prompt", "invalid_value"),
    ("a request's own chat template", "/v1/chat/completions", {**CHAT, "chat_template": NESTED_LOOPS},
     400, "chat_template", "chat_template_not_allowed"),
    ("65 stop strings", "/v1/chat/completions", {**CHAT, "n": 4, "stop": [f"s{i}" for i in range(65)]},
     400, "stop", "invalid_value"),
    ("200,000 stop strings", "/v1/chat/completions", {**CHAT, "n": 4, "stop": [f"stop{i:06d}" for i in range(200_000)]},
     413, None, "request_too_large"),
    ("a 20 MB prompt", "/v1/completions", {**COMPLETION, "prompt": "a" * 20_000_000}, 413, None, "request_too_large"),
    ("a prompt far beyond the context", "/v1/completions", {**COMPLETION, "prompt": "word " * 200_000},
     400, "prompt", "context_length_exceeded"),
    ("temperature Infinity", "/v1/chat/completions", {**CHAT, "temperature": float("inf")}, 400, "temperature", None),
    ("temperature NaN", "/v1/completions", {**COMPLETION, "temperature": float("nan")}, 400, "temperature", None),
    ("a 300-character model name", "/v1/completions", {**COMPLETION, "model": "m" * 300}, 400, "model", "invalid_value"),
    ("malformed JSON", "/v1/completions", b'{"prompt": "hi",', 400, None, "invalid_json"),
    ("bytes that are not UTF-8", "/v1/chat/completions", b'{"messages": "\xff\xfe"}', 400, None, "invalid_json"),
]


@pytest.mark.parametrize(("what", "path", "body", "status", "param", "code"), ROWS, ids=[r[0] for r in ROWS])
def test_a_hostile_request_gets_its_answer_and_harms_nothing(server: RunningServer, http: httpx.Client, what: str,
                                                             path: str, body: Any, status: int, param: str | None,
                                                             code: str | None) -> None:
    response = _served_meanwhile(server, http, lambda: _post(http, path, body))
    _error(response, status, param, code)


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of the one HTTP response on `sock` (sent `Connection: close`)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x")]))  # the request already sent
    conn.send(h11.EndOfMessage())
    status, body = 0, bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(1 << 16))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return status, bytes(body)


def test_a_stream_whose_client_never_reads_holds_only_its_latest_output(server: RunningServer,
                                                                       http: httpx.Client) -> None:
    """Streaming `n: 64` to a client that reads nothing until the engine has generated every token:
    the API process keeps the latest output of the request, not one per step (a few objects, not
    dozens), serves others meanwhile, and the client then gets every token, coalesced."""
    max_tokens = 32
    # /health also asks the core, busy with 64 samples a step, for its memory: it waits at most 2 s
    limit = max(MEANWHILE_S, 5 * max(_health_and_chat(http)[0] for _ in range(2))) + 2.0
    body = json.dumps({**COMPLETION, "n": 64, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    port = int(server.base_url.rsplit(":", 1)[1])
    # small socket buffers at both ends, as on a congested path, so that the server's writes block
    # within a few steps (loopback's would take megabytes first)
    listener = server.server.servers[0].sockets[0]  # its connections inherit the send buffer
    default_sndbuf = listener.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with stalled:
        stalled.connect(("127.0.0.1", port))
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, default_sndbuf)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

        def generated() -> bool:  # the core has finished the request (the client has read next to nothing)
            h = server.health()
            return h["running_seqs"] == 0 and h["waiting_seqs"] == 0

        server.wait_until(lambda: server.health()["running_seqs"] > 0, timeout=60, what="the stream to start")
        deadline = time.monotonic() + 240
        while not generated():
            assert time.monotonic() < deadline, server.health()
            started = time.monotonic()
            health = http.get("/health")
            assert health.status_code == 200 and time.monotonic() - started < limit
            chat = _post(http, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 1})
            assert chat.status_code == 200, chat.text
        gc.collect()
        # the stream's outputs only (the chats above may leave theirs to the collector); one held a
        # step would be max_tokens of them, the latest one a sample, in a queue and in flight, a few
        held = [o for o in gc.get_objects() if isinstance(o, RequestOutput) and o.request_id.startswith("cmpl-")]
        assert len(held) <= max_tokens // 4, f"{len(held)} outputs held for a client that reads nothing"
        stalled.settimeout(60)
        status, raw = _read_response(stalled)
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 64 * max_tokens
    with_text = [e for e in events if e["choices"]]
    assert {c["index"] for e in with_text for c in e["choices"]} == set(range(64))
    assert len(with_text) < max_tokens  # what the client missed came as one output, not step by step
    server.wait_until(lambda: server.health()["pending_requests"] == 0, timeout=30, what="nothing pending")
    assert server.state.engine.is_alive


def test_a_trusted_request_template_renders_and_an_endless_one_is_stopped(server: RunningServer,
                                                                          http: httpx.Client) -> None:
    serving = server.state.serving
    serving.trust_request_chat_template = True  # as --trust-request-chat-template sets it
    try:
        own = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}" \
              "<assistant>{% endif %}"
        answer = _post(http, "/v1/chat/completions", {**CHAT, "chat_template": own, "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] == len(server.state.serving.tokenizer.encode("<user>Hi<assistant>"))
        response = _served_meanwhile(server, http, lambda: _post(http, "/v1/chat/completions",
                                                                   {**CHAT, "chat_template": NESTED_LOOPS}))
        assert "longer than 2 s" in _error(response, 400, "chat_template")
        huge = "{{ 'x' * " + str(BODY_LIMIT + 1) + " }}"  # rendered at once, however slow the machine
        assert "more than the" in _error(_post(http, "/v1/chat/completions", {**CHAT, "chat_template": huge}),
                                         400, "chat_template")
    finally:
        serving.trust_request_chat_template = False


def test_a_slow_client_is_cut_off_before_its_headers_are_in(server: RunningServer) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        slow.settimeout(10)
        started = time.monotonic()
        assert slow.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 5
    with socket.create_connection(("127.0.0.1", port)) as idle:  # a connection that sends nothing
        idle.settimeout(10)
        assert idle.recv(1024) == b""


def test_get_routes_answer_head_and_the_schema_is_off(http: httpx.Client) -> None:
    for path in ("/health", "/ready", "/v1/models", "/metrics", "/version"):
        head = http.head(path)
        assert head.status_code == 200 and head.content == b"", path
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert http.get(path).status_code == 404, path


def test_enable_docs_serves_the_schema_and_the_docs(smol_folder: str) -> None:
    from fastapi.testclient import TestClient

    from kvpilot.runtime.args import EngineArgs
    from kvpilot.runtime.cli import build_parser
    from kvpilot.runtime.server.app import ServerConfig, ServerState, build_app

    args = build_parser().parse_args(["serve", "--enable-docs"])
    state = ServerState(EngineArgs(max_model_len=256).create_engine_config(), ServerConfig(enable_docs=args.enable_docs))
    client = TestClient(build_app(state))  # no lifespan: the routes of the docs need no engine core
    assert client.get("/docs").status_code == 200 and client.get("/redoc").status_code == 200
    schema = client.get("/openapi.json")
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    operation_ids = [op["operationId"] for path in schema.json()["paths"].values() for op in path.values()]
    assert len(operation_ids) == len(set(operation_ids)), operation_ids  # client generators need them unique


def test_a_client_that_goes_away_leaves_no_traceback(server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    body = {**COMPLETION, "max_tokens": 200, "ignore_eos": True}
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
        server.wait_until(lambda: server.health()["pending_requests"] == 0, timeout=30, what="aborted")
        time.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


# ---- random JSON at every field ---------------------------------------------------------------

SAMPLING_FIELDS = ["model", "n", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "presence_penalty",
                   "frequency_penalty", "user", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                   "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output", "priority", "logit_bias",
                   "max_tokens"]
FIELDS = {
    "/v1/completions": SAMPLING_FIELDS + ["prompt", "logprobs", "echo", "prompt_logprobs", "suffix", "best_of"],
    "/v1/chat/completions": SAMPLING_FIELDS + ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                               "add_generation_prompt", "chat_template", "tools", "tool_choice",
                                               "response_format", "prompt_logprobs"],
}
INTS = st.sampled_from([-(2**70), -(2**63) - 1, -(2**63), -1, 0, 1, 2, 3, 4, 5, 20, 21, 255, 256, 49_152, 2**31,
                        2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70])
FLOATS = st.sampled_from([float("nan"), float("inf"), -float("inf"), -1e308, 1e308, -2.5, 0.0, 1e-300, 0.5, 1.0, 2.0])
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=20),
                    st.sampled_from(["x" * 5000, "\x00", "\ud7ff" * 50]))
NESTED = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "include_usage", "a"]), inner, max_size=3)), max_leaves=8)
VALUES = st.one_of(NESTED, st.lists(INTS, min_size=1, max_size=3000), st.lists(st.text(max_size=3), max_size=300))


@st.composite
def hostile_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(sorted(FIELDS)))
    body: dict[str, Any] = dict(COMPLETION if path == "/v1/completions" else CHAT)
    body["max_tokens"] = 1
    for field in draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=3, unique=True)):
        body[field] = draw(VALUES)
    return path, body


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=hostile_bodies())
def test_random_json_at_every_field_never_gets_a_5xx(server: RunningServer, http: httpx.Client,
                                                    case: tuple[str, dict[str, Any]]) -> None:
    path, body = case
    response = _post(http, path, body)
    assert response.status_code < 500, (body, response.text[:500])
    assert server.state.engine.is_alive
    server.wait_until(lambda: server.health()["pending_requests"] == 0, timeout=30, what="nothing pending")


def test_every_code_answered_is_in_docs_errors_md() -> None:
    table = (Path(__file__).resolve().parents[3] / "docs" / "errors.md").read_text()
    documented = set(re.findall(r"^\| \d{3} \| `\w+` \| `(\w+)` \|", table, flags=re.MULTILINE))
    answered = EMITTED_CODES | {code for *_, code in ROWS if code is not None}
    assert "invalid_value" in documented and "request_too_large" in documented
    assert answered <= documented, answered - documented


def test_the_core_outlived_everything(server: RunningServer, http: httpx.Client) -> None:
    server.wait_until(lambda: server.health()["pending_requests"] == 0, timeout=30, what="nothing pending")
    assert http.get("/health").status_code == 200
    answer = _post(http, "/v1/chat/completions", {"model": MODEL, "temperature": 0, "max_tokens": 16,
                                                  "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert answer.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
