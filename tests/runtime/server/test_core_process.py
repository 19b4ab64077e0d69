"""The engine core as a process of its own behind `kvpilot serve`: a client that goes away aborts
its request inside the core, samples ended at stop strings in the API process end in the core
too, served text equals `LLM.generate`'s, and a core that dies fails every open request and
`/health` at once."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import RunningServer, start_server

from kvpilot.runtime.sampling_params import SamplingParams

LONG = {"prompt": "Count to one hundred:", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server({"max_model_len": 1024, "max_num_seqs": 4})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def async_server() -> Iterator[RunningServer]:
    """The same with async scheduling forced on (off by default on the CPU): a step is then in
    flight whenever the core applies an abort or a finished sample."""
    running = start_server({"max_model_len": 1024, "max_num_seqs": 4, "async_scheduling": True})
    yield running
    running.stop()


BOTH = pytest.mark.parametrize("which", ["server", "async_server"])


def _gauges(server: RunningServer) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text):
        for s in family.samples:
            if not s.labels.keys() - {"model_name"}:
                out[s.name] = s.value
    return out


def _data_lines(response: httpx.Response) -> Iterator[str]:
    return (line for line in response.iter_lines() if line.startswith("data:"))


def test_the_core_is_another_process(server: RunningServer) -> None:
    pid = server.state.engine.core_pid
    assert pid is not None and pid != os.getpid()
    assert server.state.engine.is_alive


@BOTH
def test_client_disconnect_aborts_inside_the_core_and_its_blocks_return(which: str, request: pytest.FixtureRequest) -> None:
    server: RunningServer = request.getfixturevalue(which)
    with ExitStack() as stack, httpx.Client(base_url=server.base_url, timeout=60) as http:
        response = stack.enter_context(http.stream("POST", "/v1/completions", json=LONG))
        lines = _data_lines(response)
        for _ in range(3):
            next(lines)
        busy = _gauges(server)
        assert busy["kvpilot_kv_cache_usage_ratio"] > 0 and busy["kvpilot_num_running_seqs"] == 1
    # the numbers below are the core's own (its snapshot after it applied the abort)
    server.wait_until(lambda: _gauges(server)["kvpilot_kv_cache_usage_ratio"] == 0.0, timeout=10,
                      what="the core to free the aborted request's blocks")
    idle = _gauges(server)
    assert idle["kvpilot_num_running_seqs"] == 0 and idle["vllm:num_requests_running"] == 0
    health = server.health()
    assert health["num_free_blocks"] == health["num_blocks"] and health["pending_requests"] == 0


@BOTH
def test_stop_strings_end_samples_as_offline_and_free_their_blocks(which: str, request: pytest.FixtureRequest,
                                                                   smol_llm) -> None:
    server: RunningServer = request.getfixturevalue(which)
    body = {"prompt": "Write three short sentences about the sea.", "max_tokens": 200, "n": 3, "seed": 7,
            "temperature": 0.8, "stop": [". "]}
    generated = _gauges(server)["vllm:generation_tokens_total"]
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300).json()
    served = sorted((c["index"], c["text"], c["finish_reason"]) for c in reply["choices"])
    offline = smol_llm.generate(body["prompt"], SamplingParams(n=3, seed=7, temperature=0.8, max_tokens=200,
                                                               stop=[". "]))[0]
    assert served == sorted((c.index, c.text, c.finish_reason) for c in offline.outputs)
    assert [reason for _, _, reason in served] == ["stop"] * 3
    server.wait_until(lambda: server.health()["num_free_blocks"] == server.health()["num_blocks"], timeout=10,
                      what="blocks of the stopped samples freed in the core")
    # the core stopped each sample a step or two after the API process found its stop string,
    # instead of running on towards max_tokens (the core counts every token it sampled)
    extra = _gauges(server)["vllm:generation_tokens_total"] - generated - reply["usage"]["completion_tokens"]
    assert 0 <= extra <= 3 * 3


def test_killing_the_core_fails_every_open_request_and_health_at_once(server: RunningServer) -> None:
    """Runs last in this module: it kills the module's core."""
    base = server.base_url
    with ExitStack() as stack, httpx.Client(base_url=base, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        streams = []
        for _ in range(2):
            response = stack.enter_context(http.stream("POST", "/v1/completions", json=LONG))
            lines = _data_lines(response)
            next(lines)
            streams.append(lines)
        plain = pool.submit(httpx.post, f"{base}/v1/completions", json={**LONG, "stream": False}, timeout=60)
        server.wait_until(lambda: server.health()["pending_requests"] == 3, what="three requests open")
        os.kill(server.state.engine.core_pid, signal.SIGKILL)
        for lines in streams:
            rest = list(lines)  # ends: no request hangs
            errors = [json.loads(line[5:]) for line in rest if line.startswith("data: {") and '"error"' in line]
            assert len(errors) == 1, rest[-3:]
            assert errors[0]["error"]["code"] == "engine_dead"
            assert "exited unexpectedly" in errors[0]["error"]["message"]
            assert rest[-1] == "data: [DONE]"
            # the same event that ended the stream failed /health: no window where it says healthy
            assert httpx.get(f"{base}/health").status_code == 503
        answer = plain.result()
        assert answer.status_code == 500 and answer.json()["error"]["code"] == "engine_dead"
    health = httpx.get(f"{base}/health")
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert httpx.get(f"{base}/ready").status_code == 503
    refused = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    assert refused.status_code == 500 and refused.json()["error"]["code"] == "engine_dead"


def test_tensor_parallel_serving_in_the_core_equals_offline_tp1(tiny_models) -> None:
    """The core starts the tensor-parallel workers itself; live re-tuning reaches every rank; and
    stopping the server stops the core and its workers."""
    from kvpilot.runtime import LLM

    folder, _ = tiny_models["llama"]
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    single = LLM(folder, max_model_len=256).generate({"prompt_token_ids": prompt},
                                                   SamplingParams(temperature=0, max_tokens=12))[0]
    running = start_server({"model": folder, "max_model_len": 256, "tensor_parallel_size": 2}, admin_token="t")
    try:
        core = running.state.engine.core_pid
        workers = _children(core)
        assert len(workers) == 1  # the rank-1 worker
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0}

        def served_ids() -> list[int]:
            reply = httpx.post(f"{running.base_url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            # no tokenizer: each token shows as "<id>"
            return [int(t[1:-1]) for t in reply.json()["choices"][0]["logprobs"]["tokens"]]

        assert served_ids() == single.outputs[0].token_ids
        changed = httpx.post(f"{running.base_url}/admin/config", json={"block_size": 8},
                             headers={"Authorization": "Bearer t"}, timeout=120)
        assert changed.status_code == 200 and changed.json()["config"]["block_size"] == 8
        assert served_ids() == single.outputs[0].token_ids
    finally:
        running.stop()
    assert not any(_alive(pid) for pid in [core, *workers])


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in out if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
