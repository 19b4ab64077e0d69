"""Limits below the routes: the size of a request body and the time a client takes to send its
request line and headers.

`BodySizeLimit` (ASGI middleware) answers 413 in OpenAI's error JSON before anything parses the
body: at once when `Content-Length` says it is too large, else as soon as the bytes read pass
the limit. `header_timeout_protocol` is uvicorn's h11 protocol with one more timer: a connection
whose request line and headers are not complete within the timeout (a slow-loris client, or one
that never sends) is closed; uvicorn's own keep-alive timeout covers an idle connection between
requests once its first response is sent.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

Scope = dict[str, Any]
Message = dict[str, Any]


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send, length.decode(errors="replace"))
            return
        body: list[bytes] = []
        size = 0
        more = True
        while more:  # the whole body is read before the app runs, as FastAPI would read it anyway
            message = await receive()
            if message["type"] != "http.request":  # gone before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, f"more than {self.max_bytes}")
                return
            body.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any, size: str) -> None:
        error = {"error": {"message": f"the request body ({size} bytes) exceeds this server's limit of "
                                      f"{self.max_bytes} bytes (--max-request-body-bytes)",
                           "type": "invalid_request_error", "param": None, "code": "request_too_large"}}
        payload = json.dumps(error).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def header_timeout_protocol(timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not in after `timeout`."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request on this connection gets the same time for its head

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
