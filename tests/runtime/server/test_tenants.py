"""Tenants at the HTTP edge: `--api-key-file` (key -> tenant), the `user` field, the per-tenant
metrics, through a real server and the official `openai` client."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import RunningServer, start_server

from kvpilot.runtime.engine.core import EngineSnapshot, StepStatsMsg
from kvpilot.runtime.server.metrics import ServerMetrics
from kvpilot.runtime.server.tenants import APIKeyFileError, APIKeys

ALPHA_KEY, BETA_KEY, SHARED_KEY = "sk-alpha-0123456789", "sk-beta-9876543210", "sk-shared-key"
MODEL = "tiny"
PROMPT = [5, 17, 42, 99, 3, 8, 1]


def _key_file(tmp: Path, text: str) -> str:
    path = tmp / "keys.txt"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def keyed_server(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder, _ = tiny_models["llama"]
    keys = APIKeys.load(_key_file(tmp_path_factory.mktemp("keys"),
                                  f"# key tenant\n{ALPHA_KEY} alpha\n\n{BETA_KEY}   beta\n"))
    running = start_server({"model": folder, "served_model_name": MODEL, "max_model_len": 128,
                            "scheduler_policy": "fair"}, api_keys=keys, api_key=SHARED_KEY)
    yield running
    running.stop()


def _tenant_metrics(server: RunningServer) -> dict[tuple[str, str], float]:
    """(metric without model_name, tenant[/kind]) -> value for the kvpilot_tenant_* series"""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text):
        for s in family.samples:
            if s.name.startswith("kvpilot_tenant_"):
                key = s.labels["tenant"] + (f"/{s.labels['kind']}" if "kind" in s.labels else "")
                out[(s.name, key)] = s.value
    return out


def _complete(server: RunningServer, key: str, user: str | None = None, max_tokens: int = 3) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    extra = {"user": user} if user is not None else {}
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True}, **extra)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.completion_tokens == max_tokens


def test_key_files_tenant_overrides_a_forged_user(keyed_server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    served = "kvpilot_tenant_served_tokens_total"
    before = _tenant_metrics(keyed_server)
    assert before[(served, "beta/prompt")] == 0  # the key file's tenants exist from the start
    with caplog.at_level(logging.DEBUG):
        _complete(keyed_server, ALPHA_KEY, user="beta", max_tokens=3)
    after = _tenant_metrics(keyed_server)
    assert after[(served, "alpha/prompt")] - before[(served, "alpha/prompt")] == len(PROMPT)
    assert after[(served, "alpha/generation")] - before[(served, "alpha/generation")] == 3
    assert after[(served, "beta/prompt")] == 0 and after[(served, "beta/generation")] == 0
    assert ALPHA_KEY not in caplog.text


def test_the_shared_api_key_serves_the_default_tenant_whatever_the_user(keyed_server: RunningServer) -> None:
    served = "kvpilot_tenant_served_tokens_total"
    before = _tenant_metrics(keyed_server)
    _complete(keyed_server, SHARED_KEY, user="alpha", max_tokens=2)
    after = _tenant_metrics(keyed_server)
    assert after[(served, "default/generation")] - before.get((served, "default/generation"), 0) == 2
    assert after[(served, "alpha/generation")] == before[(served, "alpha/generation")]


def test_a_key_outside_the_file_is_401(keyed_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key="sk-forged", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, user="alpha")
    assert httpx.post(f"{keyed_server.base_url}/v1/completions",
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).status_code == 401


def test_without_a_key_file_the_user_field_names_the_tenant(tiny_models) -> None:
    folder, _ = tiny_models["llama"]
    server = start_server({"model": folder, "served_model_name": MODEL, "max_model_len": 128})
    try:
        _complete(server, "unused", user="carol", max_tokens=2)
        _complete(server, "unused", max_tokens=1)
        m = _tenant_metrics(server)
        assert m[("kvpilot_tenant_served_tokens_total", "carol/generation")] == 2
        assert m[("kvpilot_tenant_served_tokens_total", "default/generation")] == 1
        assert m[("kvpilot_tenant_waiting_requests", "carol")] == 0
    finally:
        server.stop()


# ---- the key file -------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "line", "what"), [
    ("k1 alpha\nk2\n", 2, "expected 'KEY TENANT'"),
    ("# c\nk1 alpha extra\n", 2, "found 3 field"),
    ("k1 alpha\n\nk1 beta\n", 3, "repeats the key of line 1"),
    ("k1 al pha\n", 1, "found 3"),
    ("k1 other\n", 1, "not other"),
    ("k1 -dash\n", 1, "must be 1-64 characters"),
])
def test_malformed_key_file_names_the_line_and_never_the_key(tmp_path: Path, text: str, line: int, what: str) -> None:
    with pytest.raises(APIKeyFileError) as error:
        APIKeys.load(_key_file(tmp_path, text))
    message = str(error.value)
    assert message.startswith("api_key_file:") and f"line {line}:" in message and what in message
    assert "k1" not in message and "k2" not in message


def test_key_file_without_keys_or_missing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(APIKeyFileError, match="lists no"):
        APIKeys.load(_key_file(tmp_path, "# nothing\n\n"))
    with pytest.raises(APIKeyFileError, match="cannot read"):
        APIKeys.load(str(tmp_path / "absent.txt"))


def test_keys_are_kept_only_as_digests(tmp_path: Path) -> None:
    keys = APIKeys.load(_key_file(tmp_path, f"{ALPHA_KEY} alpha\n"))
    assert keys.tenant_of(ALPHA_KEY) == "alpha" and keys.tenant_of("sk-alpha") is None
    assert ALPHA_KEY not in repr(keys) and ALPHA_KEY.encode() not in repr(keys.tenant_by_digest).encode()


def test_serve_with_a_malformed_key_file_fails_at_start_with_one_line(tmp_path: Path) -> None:
    path = _key_file(tmp_path, f"{ALPHA_KEY} alpha\n{BETA_KEY}\n")
    kvpilot = os.path.join(os.path.dirname(sys.executable), "kvpilot")
    result = subprocess.run([kvpilot, "serve", "--api-key-file", path], capture_output=True, text=True,
                            env={**os.environ, "PYTHONSAFEPATH": "1"}, timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "--api-key-file" in lines[0] and "line 2" in lines[0], result.stderr
    assert BETA_KEY not in result.stderr and ALPHA_KEY not in result.stderr


# ---- bounded tenant labels ----------------------------------------------------------------------

def test_tenant_metrics_keep_a_bounded_label_set_and_add_up() -> None:
    metrics = ServerMetrics("m", tenants=["k1"], max_tenant_labels=2)
    stats = StepStatsMsg(0.01, 0, 0, 0, 0, 0, 0, 0, served_tokens={"t1": [5, 1], "t2": [7, 1], "t3": [11, 1]})
    snapshot = EngineSnapshot(waiting_requests_by_tenant={"t2": 2, "t3": 3, "t4": 4})
    metrics.record([], snapshot, stats)
    served, waiting = {}, {}
    for family in text_string_to_metric_families(metrics.expose().decode()):
        for s in family.samples:
            if s.name == "kvpilot_tenant_served_tokens_total" and s.labels["kind"] == "prompt":
                served[s.labels["tenant"]] = s.value
            if s.name == "kvpilot_tenant_waiting_requests":
                waiting[s.labels["tenant"]] = s.value
    assert served == {"k1": 0, "t1": 5, "other": 18}  # 2 named tenants: the key file's, then the first served
    assert waiting == {"k1": 0, "t1": 0, "other": 9}
