"""A real `kvpilot serve` (uvicorn on a loopback port) in a background thread, its engine core in a
process of its own, for server tests."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningServer:
    base_url: str
    server: Any  # kvpilot.runtime.server.app.DrainingServer
    thread: threading.Thread

    @property
    def state(self) -> Any:
        return self.server.state

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.base_url}/health").json()

    def wait_until(self, check: Any, timeout: float = 20.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; health: {self.health()}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(engine_args: dict[str, Any], **server_config: Any) -> RunningServer:
    from kvpilot.runtime.args import EngineArgs
    from kvpilot.runtime.server.app import ServerConfig, make_server

    args = EngineArgs(**engine_args)
    port = free_port()
    server = make_server(args.create_engine_config(), ServerConfig(port=port, disable_log_stats=True, **server_config),
                         log_level="warning", engine_args=args)
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    running = RunningServer(f"http://127.0.0.1:{port}", server, thread)
    deadline = time.monotonic() + 180
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return running
