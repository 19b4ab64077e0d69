"""`kvpilot serve` as a process: flag errors at start, and SIGTERM draining."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import free_port

KVPILOT = str(Path(sys.executable).parent / "kvpilot")
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}


def _serve(*flags: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVPILOT, "serve", *flags], capture_output=True, text=True, env=ENV, timeout=120, **kwargs)


def test_serve_parser_builds_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from kvpilot.runtime.cli import build_parser\n"
            "args = build_parser().parse_args(['serve', '--port', '9000', '--api-key', 'k'])\n"
            "assert args.port == 9000 and args.api_key == 'k'")
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, timeout=60)


@pytest.mark.parametrize(("flags", "named"), [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--block-size", "12"], "--block-size"),
    (["--port", "70000"], "--port"),
    (["--max-model-len", "100000000"], "--max-model-len"),
    (["--model", "/no/such/model"], "/no/such/model"),
])
def test_bad_flag_fails_at_start_with_one_line(flags: list[str], named: str) -> None:
    result = _serve(*flags)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and named in lines[0], result.stderr


def _wait_ready(base: str, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "kvpilot serve exited early"
        try:
            if httpx.get(f"{base}/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("kvpilot serve did not become ready")


def _stream_text(base: str, body: dict[str, Any]) -> tuple[str, str | None]:
    text, finish = "", None
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=240) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
    return text, finish


def test_sigterm_drains_admitted_requests_and_exits_0(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([KVPILOT, "serve", "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "4",
                             "--drain-timeout", "200", "--disable-log-stats"],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        _wait_ready(base, proc)
        # a drain as long as a loaded machine may need: it ends as soon as the requests are done
        body = {"prompt": "List the days of the week:", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            plain = [pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=240) for _ in range(3)]
            streamed = pool.submit(_stream_text, base, body)
            deadline = time.monotonic() + 30
            while httpx.get(f"{base}/health").json()["pending_requests"] < 4:
                assert time.monotonic() < deadline, "requests were not admitted"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(f"{base}/ready").status_code != 503:
                assert time.monotonic() < deadline, "/ready did not turn false"
                time.sleep(0.05)
            refused = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            for future in plain:
                response = future.result()
                assert response.status_code == 200
                assert response.json()["usage"]["completion_tokens"] == 24
            text, finish = streamed.result()
            assert finish == "length" and text == plain[0].result().json()["choices"][0]["text"]
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health")


def test_the_engine_core_exits_when_the_api_process_is_killed(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([KVPILOT, "serve", "--port", str(port), "--max-model-len", "256", "--disable-log-stats"],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        _wait_ready(base, proc)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        cores = [int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()
                 and "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(cores) == 1, children
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while not _gone(cores[0]):
            assert time.monotonic() < deadline, "the engine core outlived the API process"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
