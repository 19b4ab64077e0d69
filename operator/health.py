"""The operator's probes: `/healthz` (liveness) and `/readyz` (readiness), on one port.

Liveness only says the event loop answers: an API outage must not get the operator restarted
(it rides the outage out, retrying), so it is not a liveness failure. Readiness says the API
server is reachable now; while it is not, the operator reports itself unready.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp.web

PING_TIMEOUT_SECONDS = 2.0
CACHE_SECONDS = 1.0  # probes from several kubelets or scrapers cost one API call a second at most


class Health:
    def __init__(self, ping: Callable[[float], bool]) -> None:
        """`ping(timeout)` is True when the API server answers (it blocks: run in a thread)."""
        self._ping = ping
        self._checked_at = -CACHE_SECONDS
        self._ready = False
        self._lock = asyncio.Lock()
        self._runner: aiohttp.web.AppRunner | None = None

    async def ready(self) -> bool:
        async with self._lock:
            if time.monotonic() - self._checked_at >= CACHE_SECONDS:
                self._ready = await asyncio.to_thread(self._ping, PING_TIMEOUT_SECONDS)
                self._checked_at = time.monotonic()
            return self._ready

    async def _healthz(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text="ok\n")

    async def _readyz(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        if await self.ready():
            return aiohttp.web.Response(text="ok\n")
        return aiohttp.web.Response(status=503, text="the Kubernetes API server is not reachable\n")

    async def serve(self, port: int, host: str = "0.0.0.0") -> None:
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.get("/healthz", self._healthz), aiohttp.web.get("/readyz", self._readyz)])
        self._runner = aiohttp.web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, host, port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
