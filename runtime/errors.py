"""Errors that cross the runtime's layers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can serve nothing more (its loop crashed, or a worker process died); every open
    request fails with it, and the server's `/health` answers 503."""


class RequestError(ValueError):
    """A request the engine cannot take (bad prompt, too long, duplicate id)."""
