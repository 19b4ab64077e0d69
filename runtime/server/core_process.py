"""The engine core's process as the API process holds it: spawned (engine/core.py's `run_core`),
two ZeroMQ sockets over IPC (commands out on `input`, per-step messages back on `output`), stopped
or killed. `AsyncEngine` (async_engine.py) speaks the protocol over them.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.core import run_core

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 30.0


class CoreProcess:
    """`spawn` starts the core, which connects to sockets that `bind` makes later (ZeroMQ queues
    its messages until then)."""

    def __init__(self, config: EngineConfig, max_queue_len: int | None,
                 engine_factory: Callable[[EngineConfig], Any] | None) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="kvpilot-core-")
        # not a daemon: the core starts its own processes for tensor parallelism
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_core, name="kvpilot-engine-core", daemon=False,
            args=(config, f"ipc://{self.ipc_dir}/input", f"ipc://{self.ipc_dir}/output", max_queue_len,
                  engine_factory, logging.getLogger("kvpilot").getEffectiveLevel()))
        self.proc.start()
        self.ctx: zmq.asyncio.Context | None = None
        self.input: zmq.asyncio.Socket | None = None
        self.output: zmq.asyncio.Socket | None = None

    def kill(self) -> None:
        """Kill a core whose sockets were never bound (the server failed to come up)."""
        self.proc.kill()
        self.proc.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def bind(self) -> None:
        ctx = self.ctx = zmq.asyncio.Context()
        self.input = ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(f"ipc://{self.ipc_dir}/input")
        self.output = ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(f"ipc://{self.ipc_dir}/output")

    def send(self, message: bytes) -> None:
        assert self.input is not None
        self.input.send(message, copy=False)

    async def join(self, loop: asyncio.AbstractEventLoop, shutdown: bytes) -> None:
        """Send `shutdown` to a live core and wait for it to exit (it frees its device memory and
        tensor-parallel workers), killing it after `_STOP_TIMEOUT_S`."""
        proc = self.proc
        if proc.is_alive() and self.input is not None:
            self.send(shutdown)
            await loop.run_in_executor(None, proc.join, _STOP_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("the engine core did not stop in %.0f s: killing it", _STOP_TIMEOUT_S)
                proc.kill()
                await loop.run_in_executor(None, proc.join)

    def close(self) -> None:
        """Close the sockets (the core has exited) and remove their folder."""
        for sock in (self.input, self.output):
            if sock is not None:
                sock.close(linger=0)
        if self.ctx is not None:
            self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        self.ctx = self.input = self.output = None
