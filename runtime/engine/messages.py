"""The messages between `kvpilot serve`'s API process and its engine core (core.py).

Two ZeroMQ sockets on local IPC paths, one per direction, carry msgspec's MessagePack encoding of
the small structs below: token ids in, token ids out, never a pickled object on the hot path. The
core batches what one step produced into one `CoreOutputs` message: for each request touched,
each sample's *new* token ids, its finish reason and, when asked, the logprobs of those tokens
(and the prompt's new logprob entries); plus the step's stats and a snapshot of the scheduler and
KV cache for `/health` and `/metrics`. Commands (add, abort, finish samples, utility calls) are
applied between steps; admissions are acknowledged at once, before the next step, so a bad
request is refused before its HTTP response starts.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpilot.runtime.errors import RequestError
from kvpilot.runtime.sched.sequence import DEFAULT_TENANT
from kvpilot.runtime.tunables import LiveConfig


class QueueFullError(RuntimeError):
    """More requests wait for scheduling than `--max-queue-len` allows."""


# ---- API process -> core ----------------------------------------------------------------------

class AddRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams' constructor arguments
    arrival_time: float
    priority: int = 0
    tenant: str = DEFAULT_TENANT  # whom it is served for (the fair policy, per-tenant metrics)


class AddRequests(msgspec.Struct, tag="add", array_like=True):
    """Requests admitted all or none (the prompts of one completions request), within
    `--max-queue-len` together; acknowledged by one `Ack` under the first request's id."""

    requests: list[AddRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class FinishSeqs(msgspec.Struct, tag="finish", array_like=True):
    """Samples the API process ended at a stop string: free their blocks."""

    request_id: str
    indices: list[int]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str  # one of core.UTILITIES
    args: list[Any]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = AddRequests | AbortRequests | FinishSeqs | UtilityCall | Shutdown


# ---- core -> API process ----------------------------------------------------------------------

class EngineSnapshot(msgspec.Struct, frozen=True, array_like=True):
    """The scheduler's and KV cache's state after the latest step or command."""

    num_requests: int = 0
    num_waiting_requests: int = 0  # admitted, never scheduled yet
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_swapped_seqs: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_cache_usage: float = 0.0
    enable_prefix_caching: bool = False
    waiting_requests_by_tenant: dict[str, int] = {}  # requests waiting or swapped out, per tenant
    warming_up: bool = False  # start-up work left for after Ready still runs (engine/warm_up.py)
    # every live tunable in force, by its contract name (runtime/tunables.py), which the metrics
    # export for the operator to check each pod's config; None until the core reports
    live: LiveConfig | None = None


class StepStatsMsg(msgspec.Struct, array_like=True):
    duration_s: float
    num_batched_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    num_swapped_out: int
    swap_out_bytes: int
    swap_in_bytes: int
    swap_out_seconds: float = 0.0  # device time of the swap copies that completed
    swap_in_seconds: float = 0.0
    served_tokens: dict[str, list[int]] = {}  # tenant -> [prompt tokens, generated tokens] this step


class SeqDelta(msgspec.Struct, array_like=True):
    index: int
    token_ids: list[int]  # new since the last message
    # per new token: [(token id, logprob, rank), ...], the sampled token first; None unless asked
    logprobs: list[list[tuple[int, float, int]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    seqs: list[SeqDelta]
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int
    finished: bool
    # prompt logprobs asked: the entries new since the last message, as SeqDelta.logprobs' (the
    # first prompt token, which has none, is not sent)
    prompt_logprobs: list[list[tuple[int, float, int]]] | None = None
    error: str | None = None  # the engine ended this request alone on this error (finished is true)


class Ack(msgspec.Struct, array_like=True):
    request_id: str
    error: str | None = None  # an error kind of `error_kind`; None: admitted
    message: str = ""


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[RequestDelta]
    snapshot: EngineSnapshot
    stats: StepStatsMsg | None = None
    acks: list[Ack] = []


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    value: Any = None
    error: str | None = None
    message: str = ""


class Ready(msgspec.Struct, tag="ready", array_like=True):
    snapshot: EngineSnapshot
    pid: int
    vocab_size: int  # the model's: token ids the API process admits are below it
    startup: list[dict[str, Any]] = []  # the core's start-up phases (runtime/startup.py)


class CoreDead(msgspec.Struct, tag="dead", array_like=True):
    message: str


CoreOutput = CoreOutputs | UtilityResult | Ready | CoreDead


def error_kind(error: BaseException) -> tuple[str, str]:
    """(kind, message) of an exception that crosses to the API process."""
    if isinstance(error, QueueFullError):
        return "queue_full", str(error)
    if isinstance(error, RequestError):
        return "request", str(error)
    if isinstance(error, ValueError):
        return "value", str(error)
    return "internal", f"{type(error).__name__}: {error}"


def error_of(kind: str | None, message: str) -> BaseException:
    """The exception `error_kind` described, raised again in the API process."""
    if kind == "queue_full":
        return QueueFullError(message)
    if kind == "request":
        return RequestError(message)
    if kind == "value":
        return ValueError(message)
    return RuntimeError(message)
