"""Errors at the HTTP edge: every error a client can cause leaves as OpenAI's error JSON
(docs/errors.md lists them), FastAPI's 422 validation errors included (as 400), and the
Bearer-token check shared by the API key and the admin token."""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.runtime.server.protocol import APIError

logger = logging.getLogger(__name__)


def error_response(error: APIError) -> JSONResponse:
    headers = dict(error.headers or {})
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI (and the contract) say 400 for any invalid body
        first = error.errors()[0] if error.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return error_response(APIError(400, message, code="invalid_json"))
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", error))
        return error_response(APIError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            return error_response(APIError(404, f"no such endpoint: {error.detail}", type="not_found_error",
                                            code="not_found"))
        if error.status_code == 400 and "parsing the body" in str(error.detail):  # FastAPI's, for bytes json can't read
            return error_response(APIError(400, "the request body is not valid JSON (UTF-8)", code="invalid_json"))
        return error_response(APIError(error.status_code, str(error.detail), code="invalid_request"))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal server error: {error!r}", type="internal_error", code="internal_error"))


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_token(request: Request) -> str | None:
    return _bearer(request)


def unauthorized(what: str) -> APIError:
    return APIError(401, f"missing or wrong {what}: send 'Authorization: Bearer <{what}>'",
                    type="authentication_error", code=f"invalid_{what.replace(' ', '_')}")


def check_token(request: Request, expected: str, what: str) -> None:
    token = _bearer(request)
    if token is None or not hmac.compare_digest(token.encode(), expected.encode()):
        raise unauthorized(what)
