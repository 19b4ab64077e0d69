"""The operational side of `kvpilot serve`: health, readiness, metrics, aborts, the queue limit
and live re-configuration."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import RunningServer, start_server

ADMIN = "admin-secret"
MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "prompt": "Count to one hundred:", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(smol_folder: str) -> Iterator[RunningServer]:
    running = start_server({"max_model_len": 1024, "max_num_seqs": 2, "enable_prefix_caching": True},
                           admin_token=ADMIN, max_queue_len=2,
                           allowed_model_root=str(Path(smol_folder).parent))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _metrics(server: RunningServer) -> dict[str, float]:
    """sample name + sorted labels except model_name -> value"""
    text = httpx.get(f"{server.base_url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _idle(server: RunningServer) -> bool:
    h = server.health()
    return h["pending_requests"] == 0 and h["num_free_blocks"] == h["num_blocks"]


def _open_stream(stack: ExitStack, http: httpx.Client, body: dict[str, Any]) -> Iterator[str]:
    response = stack.enter_context(http.stream("POST", "/v1/completions", json=body))
    assert response.status_code == 200
    return response.iter_lines()


def test_health_ready_and_version(server: RunningServer) -> None:
    health = server.health()
    assert health["status"] == "healthy"
    assert health["pending_requests"] == 0 and health["kv_cache_usage"] == 0.0
    assert health["device"]["type"] in ("cpu", "cuda")
    assert httpx.get(f"{server.base_url}/ready").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_metrics_has_both_families_and_moves_as_requests_run(server: RunningServer, client: openai.OpenAI) -> None:
    before = _metrics(server)
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "kvpilot_num_running_seqs", "kvpilot_num_waiting_seqs", "kvpilot_num_swapped_seqs",
                 "kvpilot_kv_cache_usage_ratio", "kvpilot_block_size", "kvpilot_config_changes_total",
                 "kvpilot_preemption_mode{mode=recompute}", "kvpilot_preemptions_total{mode=swap}",
                 "kvpilot_swap_bytes_total{direction=in}", "kvpilot_swap_seconds_total{direction=out}",
                 "kvpilot_iteration_time_seconds_count",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count"]:
        assert name in before, name
    assert any(k.startswith("vllm:cache_config_info{block_size=16,cache_dtype=auto") for k in before)
    assert any(k.startswith("kvpilot_live_config_info{block_size=16,") for k in before)
    assert before["kvpilot_block_size"] == 16 and before["kvpilot_preemption_mode{mode=recompute}"] == 1

    reply = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5)
    after = _metrics(server)
    assert reply.usage is not None
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == reply.usage.prompt_tokens
    assert after["vllm:request_success_total{finished_reason=length}"] \
        - before.get("vllm:request_success_total{finished_reason=length}", 0) == 1
    assert after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] == 1
    assert after["vllm:request_generation_tokens_sum"] - before["vllm:request_generation_tokens_sum"] == 5
    assert after["vllm:request_prompt_tokens_sum"] - before["vllm:request_prompt_tokens_sum"] == reply.usage.prompt_tokens
    assert after["kvpilot_iteration_time_seconds_count"] - before["kvpilot_iteration_time_seconds_count"] >= 5


def test_prefix_cache_hits_count_the_reused_prompt_tokens(server: RunningServer, client: openai.OpenAI) -> None:
    prompt = "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 3
    client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2)
    before = _metrics(server)
    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2)
    after = _metrics(server)
    assert reply.usage is not None and reply.usage.prompt_tokens > 32
    queried = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert queried == reply.usage.prompt_tokens
    assert hits == (reply.usage.prompt_tokens - 1) // 16 * 16  # every full block but the last token's


def test_running_request_shows_in_gauges(server: RunningServer) -> None:
    with ExitStack() as stack, httpx.Client(base_url=server.base_url, timeout=60) as http:
        lines = _open_stream(stack, http, LONG)
        next(line for line in lines if line.startswith("data:"))
        m = _metrics(server)
        assert m["vllm:num_requests_running"] == 1 and m["kvpilot_num_running_seqs"] == 1
        assert m["vllm:kv_cache_usage_perc"] > 0
        assert server.health()["pending_requests"] == 1
    server.wait_until(lambda: _idle(server), what="idle")


def test_client_disconnect_mid_stream_frees_blocks(server: RunningServer) -> None:
    with ExitStack() as stack, httpx.Client(base_url=server.base_url, timeout=60) as http:
        lines = _open_stream(stack, http, LONG)
        for _ in range(3):
            next(line for line in lines if line.startswith("data:"))
        assert server.health()["num_free_blocks"] < server.health()["num_blocks"]
    # the stream is closed: the request is aborted and its blocks return at once
    server.wait_until(lambda: _idle(server), timeout=30, what="blocks freed after disconnect")
    assert _metrics(server)["vllm:num_requests_running"] == 0


def test_client_timeout_on_non_streaming_request_frees_blocks(server: RunningServer) -> None:
    body = {**LONG, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    server.wait_until(lambda: _idle(server), timeout=30, what="blocks freed after client timeout")


def test_full_queue_answers_429(server: RunningServer, client: openai.OpenAI) -> None:
    # max_num_seqs=2 run, max_queue_len=2 wait; the fifth request finds the queue full
    with ExitStack() as stack, httpx.Client(base_url=server.base_url, timeout=60) as http:
        running = [_open_stream(stack, http, LONG) for _ in range(2)]
        for lines in running:
            next(line for line in lines if line.startswith("data:"))
        for _ in range(2):  # a stream's headers arrive once the request is admitted
            _open_stream(stack, http, LONG)
        server.wait_until(lambda: server.health()["waiting_seqs"] == 2, what="two waiting")
        with pytest.raises(openai.RateLimitError) as info:  # (admitted, it would wait for a long stream)
            client.with_options(timeout=30).completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert info.value.code == "queue_full" and info.value.response.headers["retry-after"] == "1"
    server.wait_until(lambda: _idle(server), timeout=30, what="idle after aborting the queue")
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices


def test_several_prompts_beyond_the_queue_are_refused_whole(server: RunningServer, client: openai.OpenAI) -> None:
    # two run, one waits; of two prompts one would fit the queue (2): the request is refused whole,
    # none of its prompts is admitted, and the core is asked once
    with ExitStack() as stack, httpx.Client(base_url=server.base_url, timeout=60) as http:
        running = [_open_stream(stack, http, LONG) for _ in range(2)]
        for lines in running:
            next(line for line in lines if line.startswith("data:"))
        _open_stream(stack, http, LONG)
        server.wait_until(lambda: server.health()["waiting_seqs"] == 1, what="one waiting")
        with pytest.raises(openai.RateLimitError) as info:
            client.with_options(timeout=30).completions.create(model=MODEL, prompt=["one", "two"], max_tokens=1)
        assert info.value.code == "queue_full" and info.value.response.headers["retry-after"] == "1"
        health = server.health()
        assert health["waiting_seqs"] == 1 and health["running_seqs"] == 2 and health["pending_requests"] == 3
    server.wait_until(lambda: _idle(server), timeout=30, what="idle after the streams closed")
    with pytest.raises(openai.BadRequestError) as bad:  # more prompts than the queue could ever hold
        client.completions.create(model=MODEL, prompt=["one", "two", "three"], max_tokens=1)
    assert bad.value.param == "prompt" and "--max-queue-len 2" in bad.value.message
    assert len(client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=1).choices) == 2


def _admin(server: RunningServer, method: str, body: Any = None, token: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"{server.base_url}/admin/config", json=body, headers=headers, timeout=60)


def test_admin_config_requires_the_token(server: RunningServer) -> None:
    assert _admin(server, "GET", token=None).status_code == 401
    assert _admin(server, "POST", {"max_num_seqs": 3}, token="wrong").status_code == 401
    config = _admin(server, "GET").json()
    assert config["block_size"] == 16 and config["preemption_mode"] == "recompute"


def test_admin_config_rejects_bad_values(server: RunningServer) -> None:
    response = _admin(server, "POST", {"block_size": 12})
    assert response.status_code == 400 and response.json()["error"]["param"] == "block_size"
    assert _admin(server, "POST", {"max_model_len": 12}).status_code == 400


def test_live_block_size_change_keeps_a_running_request(server: RunningServer, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 24,
            "ignore_eos": True}
    expected = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    before = _metrics(server)["kvpilot_config_changes_total"]
    with ExitStack() as stack, httpx.Client(base_url=server.base_url, timeout=60) as http:
        lines = _open_stream(stack, http, {**body, "stream": True})
        chunks = [next(line for line in lines if line.startswith("data:")) for _ in range(3)]
        reply = _admin(server, "POST", {"block_size": 32, "max_num_seqs": 3, "scheduler_policy": "fcfs"})
        assert reply.status_code == 200, reply.text
        applied = reply.json()
        assert applied["applied"]["block_size"] == {"old": 16, "new": 32}
        assert applied["applied"]["max_num_seqs"] == {"old": 2, "new": 3}
        assert "scheduler_policy" not in applied["applied"]  # unchanged
        assert applied["duration_s"] >= 0 and applied["config"]["block_size"] == 32
        relayout = applied["relayout"]  # the running request's KV was re-laid, not recomputed
        assert (relayout["old_block_size"], relayout["new_block_size"], relayout["num_blocks"]) == (16, 32, applied["config"]["num_blocks"])
        assert relayout["num_running_kept"] == 1 and relayout["preempted"] == [] and relayout["pause_ms"] >= 0
        parts = [relayout[f] for f in ("plan_ms", "wait_ms", "copy_ms", "swap_ms", "rebuild_ms")]
        assert min(parts) >= 0 and sum(parts) <= relayout["pause_ms"]
        chunks += [line for line in lines if line.startswith("data:")]
    text = "".join(json.loads(c[5:])["choices"][0]["text"] for c in chunks if c != "data: [DONE]"
                   and json.loads(c[5:])["choices"])
    assert text == expected
    after = _metrics(server)
    assert after["kvpilot_block_size"] == 32 and after["kvpilot_config_changes_total"] == before + 1
    back = _admin(server, "POST", {"block_size": 16, "max_num_seqs": 2})
    assert back.status_code == 200 and back.json()["relayout"]["new_block_size"] == 16
    assert _admin(server, "POST", {"max_num_seqs": 2}).json()["relayout"] is None  # no block-size change


def _reload(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/reload", json=body, headers={"Authorization": f"Bearer {ADMIN}"},
                      timeout=120)


def test_reload_refuses_paths_outside_the_allowed_root(server: RunningServer) -> None:
    response = _reload(server, {"model_path": "/etc"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "path_not_allowed"
    response = _reload(server, {"model_path": f"{server.state.config.allowed_model_root}/../../etc"})
    assert response.status_code == 403


def test_reload_swaps_the_model_between_requests(server: RunningServer, client: openai.OpenAI,
                                                 smol_folder: str) -> None:
    # two reloads at once: one swaps the model, the other is refused while it runs; /health answers
    # throughout (the event loop stays free), and afterwards the new core lives with nothing pending
    healths: list[tuple[float, int, bool]] = []  # (seconds, status, reloading)
    reloaded = threading.Event()

    def poll_health() -> None:
        while not reloaded.is_set():
            started = time.monotonic()
            answer = httpx.get(f"{server.base_url}/health", timeout=60)
            healths.append((time.monotonic() - started, answer.status_code, answer.json()["reloading"]))
            time.sleep(0.05)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(_reload, [server] * 2, [{"model_path": smol_folder,
                                                             "served_model_name": "smol-reloaded"}] * 2))
    finally:
        reloaded.set()
        poller.join()
    assert sorted(r.status_code for r in replies) == [200, 409], [r.text for r in replies]
    during = [(s, status) for s, status, reloading in healths if reloading]
    assert during, healths  # asked while the new core was being built
    assert all(status == 200 and s < 5 for s, status in during), during
    assert server.state.engine.is_alive and server.health()["pending_requests"] == 0
    reply = next(r for r in replies if r.status_code == 200)
    assert next(r for r in replies if r.status_code == 409).json()["error"]["code"] == "conflict"
    assert reply.json()["model"] == "smol-reloaded"
    assert [m.id for m in client.models.list().data] == ["smol-reloaded"]
    answer = client.chat.completions.create(model="smol-reloaded", temperature=0, max_tokens=16,
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert answer.choices[0].message.content == "The capital of France is Paris."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert 'model_name="smol-reloaded"' in httpx.get(f"{server.base_url}/metrics").text
    assert _reload(server, {"model_path": smol_folder, "served_model_name": MODEL}).status_code == 200
