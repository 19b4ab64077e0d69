"""Stand-ins for the HTTP surface of a `kvpilot serve` pod that the operator uses: `/metrics` in
the runtime's names and buckets (autotune_fixtures.PodMetrics) and Bearer-authenticated
`GET/POST /admin/config` with the engine's answer layout. The queue and KV usage a stand-in
reports are set by the test; every scrape counts five finished requests while it is `serving`
(a test holds a canary undecidable, for as long as it needs, by turning that off).

`EnginePod.app()` serves one on the test's own event loop; `ThreadedEngines` serves them from a
thread of their own, for synchronous tests whose operator runs in another process."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiohttp.web
from autotune_fixtures import PodMetrics

from kvpilot.operator.autotune import LiveConfig

RELAYOUT_PAUSE_MS = 12.5  # what a stand-in reports a block-size change paused it for


class EnginePod:
    """A stand-in for one engine pod's HTTP surface the operator uses."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.waiting, self.kv = 0.0, 0.2
        self.serving = True  # False: scrapes count no finished request, so nothing can be judged
        self.scrapes = 0
        self.refuse: str | None = None  # POST /admin/config answers 400 with this message
        self.posts: list[dict[str, Any]] = []
        self.restart()

    def restart(self) -> None:
        """A new process: counters from zero, the flags' config (16, recompute)."""
        self.config = {"block_size": 16, "preemption_mode": "recompute", "scheduler_policy": "fcfs",
                       "max_num_seqs": 256, "max_num_batched_tokens": 2048, "max_model_len": 2048,
                       "num_blocks": 1000}
        self.metrics = PodMetrics(block_size=16, mode="recompute")

    async def metrics_page(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        self.scrapes += 1
        self.metrics.set(waiting=self.waiting, running=8, kv=self.kv)
        if self.serving:
            self.metrics.serve(5)
        return aiohttp.web.Response(body=self.metrics.text().encode(), content_type="text/plain")

    def _authorized(self, request: aiohttp.web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {self.token}"

    async def admin_config(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if not self._authorized(request):
            return aiohttp.web.json_response({"error": {"message": "bad token"}}, status=401)
        if request.method == "GET":
            return aiohttp.web.json_response(self.config)
        changes = await request.json()
        self.posts.append(changes)
        if self.refuse is not None:
            return aiohttp.web.json_response({"error": {"message": self.refuse}}, status=400)
        applied = {k: {"old": self.config[k], "new": v} for k, v in changes.items() if self.config[k] != v}
        self.config.update(changes)
        self.metrics.configure(LiveConfig.from_json(self.config), 1000)
        relayout = {"pause_ms": RELAYOUT_PAUSE_MS} if "block_size" in applied else None
        return aiohttp.web.json_response({"applied": applied, "duration_s": 0.001, "config": self.config,
                                          "relayout": relayout})

    @property
    def settings(self) -> tuple[int, str]:
        return self.config["block_size"], self.config["preemption_mode"]

    def app(self) -> aiohttp.web.Application:
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.get("/metrics", self.metrics_page),
                        aiohttp.web.route("*", "/admin/config", self.admin_config)])
        return app


async def serve(pod: EnginePod, host: str = "127.0.0.1") -> tuple[aiohttp.web.AppRunner, int]:
    """`pod` on a free port of `host`: the runner (to clean up) and the port."""
    runner = aiohttp.web.AppRunner(pod.app(), access_log=None)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, host, 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # noqa: SLF001


class ThreadedEngines:
    """Stand-ins served by an event loop in a thread of their own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine stand-ins", daemon=True)
        self.thread.start()
        self.runners: list[aiohttp.web.AppRunner] = []

    def start(self, token: str) -> tuple[EnginePod, int]:
        """A new stand-in and the port it serves on."""
        pod = EnginePod(token)
        runner, port = asyncio.run_coroutine_threadsafe(serve(pod), self.loop).result(30)
        self.runners.append(runner)
        return pod, port

    def close(self) -> None:
        for runner in self.runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
