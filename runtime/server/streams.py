"""Where each request's outputs go, in the API process: its `RequestStream` (vLLM's output
collector), which the HTTP handler reads, and `deliver`, which turns one core message's deltas
into outputs (output_processor.py) and hands each to its stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvpilot.runtime.engine.messages import AbortRequests, FinishSeqs, RequestDelta
from kvpilot.runtime.errors import RequestFailedError
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.server.output_processor import OutputProcessor


class RequestStream:
    """The outputs of one request, in order, ending after the finished one or an error. Outputs
    are cumulative, so only the latest unread one is kept (as vLLM's output collector does): a
    client that reads slowly holds one output, not a queue of them."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._output = output  # replaces one not read yet: it holds everything that one did
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The latest output not read yet (waiting for one); raises the stream's error."""
        await self._ready.wait()
        if self._error is not None:
            raise self._error
        output, self._output = self._output, None
        self._ready.clear()
        assert output is not None
        return output

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            output = await self.get()
            yield output
            if output.finished:
                return


def deliver(deltas: list[RequestDelta], streams: dict[str, RequestStream], processor: OutputProcessor,
            send: Callable[[Any], None]) -> list[RequestOutput]:
    """Each delta's output, put on its request's stream (a request that ends leaves `streams`);
    `send` tells the core of samples ended here at a stop string. The outputs delivered."""
    outputs: list[RequestOutput] = []
    for delta in deltas:
        stream = streams.get(delta.request_id)
        if stream is None:  # aborted meanwhile
            continue
        out, stopped = processor.process(delta)
        if out is None:
            continue
        if delta.error is not None:  # the core ended this request alone
            stream.fail(RequestFailedError(f"the engine failed this request: {delta.error}"))
            del streams[delta.request_id]
            continue
        if stopped and not out.finished:
            send(FinishSeqs(delta.request_id, stopped))
        elif out.finished and not delta.finished:
            send(AbortRequests([delta.request_id]))  # ended here at a stop string
        outputs.append(out)
        stream.put(out)
        if out.finished:
            stream.finished = True
            del streams[delta.request_id]
    return outputs
