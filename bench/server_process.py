"""A fresh `kvpilot serve` process on a loopback port, for benchmarks that compare configurations
each on its own server: started with the given flags, ready when `/ready` answers 200 and `/health`
says the work it does after Ready is done, stopped
with SIGTERM (then SIGKILL) however the block exits. Its log goes to a file, quoted when it dies."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvpilot_command() -> list[str]:
    """The `kvpilot` console script beside this interpreter, else the module through it."""
    script = Path(sys.executable).parent / "kvpilot"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvpilot.runtime.cli"]


@asynccontextmanager
async def serve(flags: Sequence[str], log_path: Path, startup_timeout_s: float = 600.0) -> AsyncIterator[str]:
    """Yields the server's base URL."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*kvpilot_command(), "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONSAFEPATH": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(base, proc, log_path, startup_timeout_s)
        yield base
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)


async def _wait_ready(base: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text().strip().splitlines()[-5:]
                raise ServerStartError(f"kvpilot serve exited with {proc.returncode}: {' | '.join(tail)}")
            try:
                async with session.get(f"{base}/ready", timeout=aiohttp.ClientTimeout(total=5)) as response:
                    ready = response.status == 200
                # and done with the start-up work it does after Ready (other block sizes' kernels and
                # graphs), which would otherwise stall the first seconds of a measurement
                if ready:
                    async with session.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=5)) as response:
                        if not (await response.json()).get("warming_up", False):
                            return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if loop.time() > deadline:
                raise ServerStartError(f"kvpilot serve was not ready within {timeout_s:g} s (log: {log_path})")
            await asyncio.sleep(0.5)
