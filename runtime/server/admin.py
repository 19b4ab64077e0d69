"""Admin endpoints (Bearer `--admin-token`; 404 when no token is set): `GET/POST /admin/config`
re-tunes the live engine between steps without dropping a request, and `POST /reload` swaps the
served model for one under `--allowed-model-root`."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request

from kvpilot.runtime.server.errors import check_token
from kvpilot.runtime.server.protocol import APIError
from kvpilot.runtime.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from kvpilot.runtime.args import EngineArgs
    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.server.async_engine import AsyncEngine
    from kvpilot.runtime.server.metrics import ServerMetrics
    from kvpilot.runtime.server.openai_serving import OpenAIServing
    from kvpilot.runtime.tokenizer import Tokenizer


class AdminSettings(Protocol):
    """What the admin routes read of `app.ServerConfig`."""

    admin_token: str | None
    allowed_model_root: str | None
    drain_timeout: float


class ServerState(Protocol):
    """What the admin routes use of the server's state (`app.ServerState`, whose module imports
    this one, so it is named here only by what it holds)."""

    @property
    def config(self) -> AdminSettings: ...

    engine: AsyncEngine
    engine_args: EngineArgs | None
    metrics: ServerMetrics
    serving: OpenAIServing
    model_name: str
    draining: bool
    reloading: bool
    reload_lock: asyncio.Lock

    def set_model(self, engine_config: EngineConfig, tokenizer: Tokenizer | None) -> None: ...


def add_admin_routes(app: FastAPI, state: ServerState) -> None:
    def authorize(request: Request) -> None:
        token = state.config.admin_token
        if token is None:
            raise APIError(404, "admin endpoints are disabled: start the server with --admin-token "
                           "(or KVPILOT_ADMIN_TOKEN)", type="not_found_error", code="admin_disabled")
        check_token(request, token, "admin token")

    @app.get("/admin/config")
    @app.head("/admin/config", include_in_schema=False)
    async def get_config(request: Request) -> dict[str, Any]:
        authorize(request)
        return await state.engine.live_config()

    @app.post("/admin/config")
    async def post_config(request: Request) -> dict[str, Any]:
        authorize(request)
        changes = await _json_body(request)
        if not isinstance(changes, dict) or not changes:
            raise APIError(400, "send a JSON object of tunables, e.g. {\"block_size\": 32}", code="invalid_value")
        started = time.perf_counter()
        try:
            result = await state.engine.update_config(changes)
        except ValueError as e:
            message = str(e)
            head = message.partition(":")[0]
            raise APIError(400, message, param=head if head.isidentifier() else None, code="invalid_value") from None
        duration = time.perf_counter() - started
        applied = result["applied"]
        if applied:
            state.metrics.record_config_change()
        config = await state.engine.live_config()
        state.serving.max_num_seqs = config["max_num_seqs"]
        # a block-size change re-lays the KV cache between steps: its pause, the bytes it moved
        # and the requests it had to recompute (none unless the new cut could not hold them)
        return {"applied": applied, "duration_s": round(duration, 6), "config": config, "relayout": result["relayout"]}

    @app.post("/reload")
    async def reload(request: Request) -> dict[str, Any]:
        authorize(request)
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise APIError(400, "send {\"model_path\": \"/path/under/allowed-model-root\"}", param="model_path",
                           code="invalid_value")
        name = body.get("served_model_name")
        if name is not None and not isinstance(name, str):
            raise APIError(400, "served_model_name must be a string", param="served_model_name", code="invalid_value")
        return await reload_model(state, body["model_path"], name)


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None


async def reload_model(state: ServerState, model_path: str, served_model_name: str | None) -> dict[str, Any]:
    """Swap the served model: refuse new requests, let admitted ones finish (bounded by
    drain_timeout), then replace the engine core by one built for the new model."""
    root = state.config.allowed_model_root
    if state.engine_args is None or root is None:
        raise APIError(403, "reloading is disabled: start the server with --allowed-model-root",
                       type="permission_error", code="reload_disabled")
    real_root, path = os.path.realpath(root), os.path.realpath(model_path)
    if os.path.commonpath([real_root, path]) != real_root:
        raise APIError(403, f"model_path must lie inside --allowed-model-root ({root})",
                       type="permission_error", param="model_path", code="path_not_allowed")
    if state.reload_lock.locked() or state.reloading or state.draining:
        raise APIError(409, "a reload or a drain is already in progress", code="conflict")
    async with state.reload_lock:  # taken with no await since the check: a second reload gets 409
        return await _reload_locked(state, path, served_model_name)


async def _reload_locked(state: ServerState, path: str, served_model_name: str | None) -> dict[str, Any]:
    assert state.engine_args is not None
    args = dataclasses.replace(state.engine_args, model=path, served_model_name=served_model_name)
    try:
        new_config = await asyncio.get_running_loop().run_in_executor(None, args.create_engine_config)
    except ValueError as e:  # ModelSourceError included
        raise APIError(400, str(e), param="model_path", code="invalid_model") from None
    if state.draining:
        raise APIError(409, "a drain began while the new model was checked", code="conflict")
    state.reloading = True
    try:
        started = time.perf_counter()
        if not await state.engine.wait_idle(state.config.drain_timeout):
            state.engine.abort_all()

        tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, new_config)
        await state.engine.reload(new_config, tokenizer)
        state.engine_args = args
        state.set_model(new_config, tokenizer)
        return {"model": state.model_name, "model_path": path, "duration_s": round(time.perf_counter() - started, 3)}
    finally:
        state.reloading = False
