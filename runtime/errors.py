"""Errors that cross the runtime's layers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can serve nothing more (its loop crashed, or a worker process died); every open
    request fails with it, and the server's `/health` answers 503."""


class RequestError(ValueError):
    """A request the engine cannot take (bad prompt, too long, duplicate id)."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (an error while sampling or post-processing it); the
    engine ended that request alone and serves the others."""


class RowsFailedError(Exception):
    """Sampling failed for some rows of a step (a value no tensor or generator can hold): `errors`
    maps each failing row's sequence id to its error. The step ran nothing else the host must undo;
    the engine ends those requests and launches the step again without them."""

    def __init__(self, errors: dict[int, str]) -> None:
        super().__init__("; ".join(f"sequence {seq_id}: {message}" for seq_id, message in errors.items()))
        self.errors = errors
