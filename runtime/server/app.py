"""The HTTP server of `kvpilot serve`: FastAPI routes over an `AsyncEngine`.

This is the API process: HTTP, chat templates, tokenising, detokenising and streaming happen
here, while the step loop runs in the engine core, a process of its own that the lifespan starts
and stops (async_engine.py, core.py). `/health` fails with 503 the moment the core dies.

Routes and their contract are in ARCHITECTURE.md ("HTTP contract"); the OpenAI endpoints'
logic lives in openai_serving.py, the admin endpoints in admin.py, and every error a client can
cause leaves through errors.py as OpenAI's error JSON (docs/errors.md lists them).

*Draining* (SIGTERM): new requests get 503 and `/ready` turns false while admitted requests
finish, bounded by `drain_timeout`; then whatever is left is aborted and uvicorn exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpilot.runtime.args import EngineArgs
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.server.admin import add_admin_routes
from kvpilot.runtime.server.async_engine import AsyncEngine
from kvpilot.runtime.server.errors import add_error_handlers, bearer_token, unauthorized
from kvpilot.runtime.server.http_limits import BodySizeLimit, header_timeout_protocol
from kvpilot.runtime.server.metrics import ServerMetrics
from kvpilot.runtime.server.openai_serving import OpenAIServing
from kvpilot.runtime.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kvpilot.runtime.server.tenants import APIKeys, resolve_tenant
from kvpilot.runtime.startup import StartupLog, startup_record
from kvpilot.runtime.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

KV_USAGE_WARN = 0.9  # /health says "warn" above this KV-cache usage


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_keys: APIKeys | None = None  # --api-key-file: key -> tenant (tenants.py)
    admin_token: str | None = None
    max_queue_len: int | None = None
    disable_log_stats: bool = False
    metric_interval: float = 10.0
    drain_timeout: float = 30.0
    allowed_model_root: str | None = None
    max_request_body_bytes: int = 8 << 20  # larger bodies get 413 before they are parsed
    header_read_timeout: float = 10.0  # seconds a client has to send a request line and headers
    trust_request_chat_template: bool = False  # render `chat_template` sent in requests (sandboxed)
    enable_docs: bool = False  # serve /docs, /redoc and /openapi.json

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port: must be in 1..65535, not {self.port}")
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes: must be at least 1024, not {self.max_request_body_bytes}")
        if not self.header_read_timeout > 0:
            raise ValueError(f"header_read_timeout: must be positive, not {self.header_read_timeout}")
        if self.metric_interval <= 0:
            raise ValueError(f"metric_interval: must be positive, not {self.metric_interval}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout: must be >= 0, not {self.drain_timeout}")


class ServerState:
    """What the routes share: the engine front, metrics, and the draining flag."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig, engine_args: EngineArgs | None = None,
                 engine_factory: Any = None, startup: StartupLog | None = None,
                 engine: AsyncEngine | None = None) -> None:
        self.config = config
        # where start-up time went (runtime/startup.py): completed when the socket listens
        self.startup = startup or StartupLog("api", [])
        self.startup_record: dict[str, Any] | None = None
        self.engine_args = engine_args  # what /reload changes the model of; None: no reloads
        self.draining = False
        self.reloading = False
        self.started = False
        self.device = engine_config.device.device
        self.metrics = ServerMetrics(engine_config.model.served_model_name, self.known_tenants,
                                     cache_dtype=engine_config.cache.kv_cache_dtype)
        with self.startup.phase("tokenizer"):
            tokenizer = load_tokenizer(engine_config)
        if engine is None:
            engine = AsyncEngine(engine_config, max_queue_len=config.max_queue_len, engine_factory=engine_factory)
        engine.attach_tokenizer(tokenizer)
        engine.on_step = self.metrics.record
        self.engine = engine
        self.serving = OpenAIServing(self.engine, tokenizer, self.metrics.model_name, self._refusal,
                                     max_queue_len=config.max_queue_len,
                                     trust_request_chat_template=config.trust_request_chat_template,
                                     max_prompt_chars=config.max_request_body_bytes)
        # taken before a reload's first await: two reloads never overlap (admin.py)
        self.reload_lock = asyncio.Lock()
        self.set_model(engine_config, tokenizer)

    def set_model(self, engine_config: EngineConfig, tokenizer: Tokenizer | None) -> None:
        self.model_name = engine_config.model.served_model_name
        self.max_model_len = engine_config.model.max_model_len
        self.serving.model_name = self.model_name
        self.serving.max_model_len = self.max_model_len
        self.serving.max_num_seqs = engine_config.scheduler.max_num_seqs
        self.serving.tokenizer = tokenizer
        if self.metrics.model_name != self.model_name:
            self.metrics = ServerMetrics(self.model_name, self.known_tenants,
                                         cache_dtype=engine_config.cache.kv_cache_dtype)
            self.engine.on_step = self.metrics.record

    @property
    def known_tenants(self) -> list[str]:
        """Tenants whose metric series exist from the start: the key file's."""
        return self.config.api_keys.tenants if self.config.api_keys is not None else []

    def _refusal(self) -> APIError | None:
        if self.draining:
            return APIError(503, "the server is shutting down and takes no new requests; retry on another replica",
                            type="service_unavailable_error", code="draining")
        if self.reloading:
            return APIError(503, "the server is loading a new model; retry in a moment",
                            type="service_unavailable_error", code="reloading")
        return None

    def report_startup(self) -> None:
        """Log the start-up record, one JSON line, and keep it for `GET /ready`."""
        phases = self.startup.as_list() + self.engine.core_startup
        self.startup_record = startup_record(self.startup.phases[0].start if self.startup.phases else time.time(),
                                             time.time(), phases)
        logger.info("startup: %s", json.dumps(self.startup_record))

    async def drain(self) -> None:
        """Stop admitting; let admitted requests finish within the grace period; abort the rest."""
        self.draining = True
        logger.info("draining: %d requests in flight, up to %.0f s", self.engine.num_pending_requests,
                    self.config.drain_timeout)
        if not await self.engine.wait_idle(self.config.drain_timeout):
            logger.warning("drain timeout: aborting %d requests", self.engine.num_pending_requests)
            self.engine.abort_all()
        logger.info("drained")


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            with state.startup.phase("engine_core"):  # spawned, until its engine is built
                await state.engine.start()
        except BaseException:
            await state.engine.stop()
            raise
        state.started = True
        log_task = None if state.config.disable_log_stats else asyncio.create_task(_log_stats(state))
        try:
            yield
        finally:
            if log_task is not None:
                log_task.cancel()
            state.engine.abort_all()
            await state.engine.stop()

    docs = state.config.enable_docs  # the schema lists the admin routes: off unless asked for
    app = FastAPI(title="kvpilot", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.kvpilot = state
    app.add_middleware(BodySizeLimit, max_bytes=state.config.max_request_body_bytes)
    add_error_handlers(app)
    _add_openai_routes(app, state)
    _add_ops_routes(app, state)
    add_admin_routes(app, state)
    return app


# ---- routes ----------------------------------------------------------------------------------

def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    def authorize(request: Request, user: str | None = None) -> str:
        """Check the API key; returns the request's tenant (tenants.py)."""
        tenant = resolve_tenant(state.config.api_keys, state.config.api_key, bearer_token(request), user)
        if tenant is None:
            raise unauthorized("api key")
        return tenant

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        tenant = authorize(request, body.user)
        return await state.serving.chat(body, request, tenant)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tenant = authorize(request, body.user)
        return await state.serving.completions(body, request, tenant)

    @app.get("/v1/models")
    @app.head("/v1/models", include_in_schema=False)  # HEAD too, left out of the schema: one operation id a path
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "kvpilot",
            "root": state.model_name, "max_model_len": state.max_model_len,
        }]}


def _add_ops_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health() -> JSONResponse:
        snap = state.engine.snapshot
        body: dict[str, Any] = {
            "status": "healthy",
            "pending_requests": state.engine.num_pending_requests,
            "running_seqs": snap.num_running_seqs,
            "waiting_seqs": snap.num_waiting_seqs,
            "kv_cache_usage": round(snap.kv_cache_usage, 4),
            "num_free_blocks": snap.num_free_blocks,
            "num_blocks": snap.num_blocks,
            "draining": state.draining,
            "reloading": state.reloading,
            # start-up work done after Ready (other block sizes' kernels and graphs) still runs
            "warming_up": snap.warming_up,
            "device": await _device_memory(state),
        }
        if not state.engine.is_alive:
            body["status"] = "error"
            body["message"] = str(state.engine.error or "the engine core is not running")
            return JSONResponse(body, status_code=503)
        warnings = []
        if snap.kv_cache_usage > KV_USAGE_WARN:
            warnings.append(f"KV cache {snap.kv_cache_usage:.0%} full: requests may be preempted")
        limit = state.config.max_queue_len
        if limit is not None and snap.num_waiting_seqs >= 0.8 * limit:
            warnings.append(f"queue nearly full ({snap.num_waiting_seqs} of {limit} waiting)")
        if warnings:
            body["status"] = "warn"
            body["message"] = "; ".join(warnings)
        return JSONResponse(body)

    @app.get("/ready")
    @app.head("/ready", include_in_schema=False)
    async def ready() -> JSONResponse:
        if state.draining or state.reloading:
            reason = "draining" if state.draining else "reloading"
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        if not state.engine.is_alive:
            return JSONResponse({"ready": False, "reason": "engine not running"}, status_code=503)
        return JSONResponse({"ready": True, "model": state.model_name, "startup": state.startup_record})

    @app.get("/version")
    @app.head("/version", include_in_schema=False)
    async def version_() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics")
    @app.head("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(state.metrics.expose(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _device_memory(state: ServerState) -> dict[str, Any]:
    """Measured by the engine core, whose process holds the model and the KV cache."""
    if not state.engine.is_alive or state.reloading:
        return {"type": state.device}
    try:
        async with asyncio.timeout(2.0):  # not wait_for: on Python 3.11 it can drop a cancellation
            return await state.engine.device_memory()  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - a busy or dying core must not make /health hang or fail
        return {"type": state.device}


def _version() -> str:
    try:
        return version("kvpilot")
    except PackageNotFoundError:
        return "unknown"


async def _log_stats(state: ServerState) -> None:
    interval = state.config.metric_interval
    while True:
        await asyncio.sleep(interval)
        steps, seconds = state.metrics.take_interval()
        snap = state.engine.snapshot
        if not steps and not snap.num_requests:
            continue  # idle: nothing worth a line
        mean_ms = 1000 * seconds / steps if steps else 0.0
        logger.info("iteration %.1f ms (mean of %d steps), running %d seqs, waiting %d seqs, KV cache %.1f%%",
                    mean_ms, steps, snap.num_running_seqs, snap.num_waiting_seqs, 100 * snap.kv_cache_usage)


# ---- running it ------------------------------------------------------------------------------

class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains before exiting; a second one exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:  # listening: requests are served from here on
            self.state.report_startup()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None:
            super().handle_exit(sig, frame)
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            await self.state.drain()
            self.should_exit = True
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(drain_then_exit())


def make_server(engine_config: EngineConfig, config: ServerConfig, log_level: str = "info",
                engine_args: EngineArgs | None = None, engine_factory: Any = None,
                startup: StartupLog | None = None, engine: AsyncEngine | None = None) -> DrainingServer:
    """The server; its lifespan starts the engine core from `engine_config` (built there by
    `engine_factory(engine_config)`, default `LLMEngine`), or waits for `engine`'s, spawned earlier."""
    state = ServerState(engine_config, config, engine_args, engine_factory, startup, engine)
    uv_config = uvicorn.Config(build_app(state), host=config.host, port=config.port, log_level=log_level,
                               timeout_graceful_shutdown=max(1, int(config.drain_timeout)),
                               http=header_timeout_protocol(config.header_read_timeout))
    return DrainingServer(uv_config, state)
