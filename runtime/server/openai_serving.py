"""`/v1/chat/completions` and `/v1/completions`: request -> engine request -> OpenAI response.

Both endpoints share one flow: check the model, convert the body to `SamplingParams`, admit the
request (errors become `APIError`s, so a client gets a 400/429 before any stream starts), then
either collect the final output or stream SSE chunks. A completions request with several prompts
is one engine request a prompt, admitted all or none; its choices are numbered prompt by prompt
(prompt i's sample j is choice i * n + j), as OpenAI numbers them. The engine's texts are
cumulative and never shrink, so a stream's delta is `text[len(sent):]`. A client that goes
away, or a stream that is cancelled, aborts its request, which frees its KV blocks before the
next step.

With `echo` a completion's first chunk (or its whole text) starts with the prompt, and its
logprobs with the prompt's; with `max_tokens: 0` as well, the one token the engine generates is
left out of the response. The bodies themselves (choices, logprobs, usage) are built by
response_bodies.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpilot.runtime.errors import RequestError, RequestFailedError
from kvpilot.runtime.outputs import CompletionOutput, RequestOutput
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.sequence import DEFAULT_TENANT
from kvpilot.runtime.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from kvpilot.runtime.server.chat_templates import render_chat
from kvpilot.runtime.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kvpilot.runtime.server.response_bodies import (
    chat_choice,
    completion_choice,
    numbered,
    prompt_text,
    usage_of,
    without_generated,
)
from kvpilot.runtime.tokenizer import Tokenizer, check_prompt

# a prompt as the engine takes it: its text (None when sent as token ids) and its token ids
Encoded = tuple[str | None, list[int]]

# a choice of one chunk/response, built from its request's output, one completion (numbered as a
# choice) and the numbers of characters and tokens of it already sent
ChoiceBuilder = Callable[[RequestOutput, CompletionOutput, int, int], dict[str, Any]]
RETRY_AFTER_S = 1  # a 429's Retry-After: the queue moves every engine step


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer | None, model_name: str,
                 unavailable: Callable[[], APIError | None], max_queue_len: int | None = None,
                 trust_request_chat_template: bool = False, max_prompt_chars: int = 1 << 23) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.unavailable = unavailable  # why the server takes no new requests now, if it doesn't
        self.max_queue_len = max_queue_len  # also the most prompts one completions request may hold
        self.trust_request_chat_template = trust_request_chat_template
        self.max_prompt_chars = max_prompt_chars  # the most a body can carry: a rendered template's limit
        # the engine's limits a request must fit in (set by the server; max_num_seqs is live-tunable)
        self.max_model_len: int | None = None
        self.max_num_seqs: int | None = None

    # ---- endpoints -------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request, tenant: str = DEFAULT_TENANT) -> Response:
        self._check_model(body.model)
        self._check_available()
        params = _to_params(body.to_sampling_params)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template; use /v1/completions "
                           "with prompt token ids", param="messages", code="no_chat_template")
        try:
            messages = [m.as_template_input() for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        prompt = await render_chat(self.tokenizer, messages, body.add_generation_prompt, body.chat_template,
                                   self.trust_request_chat_template, self.max_prompt_chars)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        top = body.top_logprobs or 0
        return await self._serve(request_id, [prompt], params, body.priority, raw, body.stream, body.include_usage,
                                 body.stream_options is not None and body.stream_options.continuous_usage_stats,
                                 "chat.completion",
                                 lambda _out, c, chars, tokens: chat_choice(c, chars, tokens, top, body.stream, self.tokenizer),
                                 tenant=tenant, prompt_field="messages")

    async def completions(self, body: CompletionRequest, raw: Request, tenant: str = DEFAULT_TENANT) -> Response:
        self._check_model(body.model)
        self._check_available()
        params = _to_params(body.to_sampling_params)
        prompts = _to_params(body.prompts)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        echoes = [prompt_text(p, self.tokenizer) for p in prompts] if body.echo else None
        echo_logprobs = body.logprobs if body.echo else None

        def choice(out: RequestOutput, c: CompletionOutput, chars: int, tokens: int) -> dict[str, Any]:
            echo = echoes[c.index // params.n] if echoes is not None else None
            return completion_choice(out, c, chars, tokens, self.tokenizer, echo, echo_logprobs, body.prompt_logprobs)

        return await self._serve(request_id, prompts, params, body.priority, raw, body.stream, body.include_usage,
                                 body.stream_options is not None and body.stream_options.continuous_usage_stats,
                                 "text_completion", choice, tenant=tenant, prompt_only=body.prompt_only)

    # ---- the shared flow -------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    def _check_available(self) -> None:
        refusal = self.unavailable()
        if refusal is not None:
            raise refusal

    async def _serve(self, request_id: str, prompts: list[str | list[int]], params: SamplingParams, priority: int,
                     raw: Request, stream: bool, include_usage: bool, continuous_usage: bool, kind: str,
                     choice: ChoiceBuilder, tenant: str = DEFAULT_TENANT, prompt_only: bool = False,
                     prompt_field: str = "prompt") -> Response:
        encoded = await self._within_limits(prompts, params, prompt_field)
        streams = await self._admit(request_id, encoded, params, priority, tenant)
        created = int(time.time())
        view = without_generated if prompt_only else None
        if stream:
            chunks = self._stream(request_id, streams, params.n, created, kind, choice, include_usage,
                                  continuous_usage, view)
            return StreamingResponse(chunks, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finals = await self._collect(streams, raw)
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        if view is not None:
            finals = [view(final) for final in finals]
        return JSONResponse({
            "id": request_id, "object": kind, "created": created, "model": self.model_name,
            "choices": [choice(final, numbered(c, i * params.n), 0, 0) for i, final in enumerate(finals)
                        for c in final.outputs],
            "usage": usage_of(finals),
        })

    async def _within_limits(self, prompts: list[str | list[int]], params: SamplingParams,
                             prompt_field: str) -> list[Encoded]:
        """Refuses, before the engine core sees it, what it could never serve: more prompts than
        its queue holds, more samples than it runs at once, token ids or `top_k` beyond the
        vocabulary, a prompt plus `max_tokens` beyond the context (OpenAI's and vLLM's 400). Text
        prompts are tokenized here, off the event loop, after a length check that needs no
        tokenizing; the prompts are handed on as (text, token ids)."""
        if self.max_queue_len is not None and len(prompts) > self.max_queue_len:
            raise APIError(400, f"{prompt_field}: {len(prompts)} prompts exceed this server's queue "
                           f"(--max-queue-len {self.max_queue_len}); send at most that many per request",
                           param=prompt_field, code="invalid_value")
        if self.max_num_seqs is not None and params.n > self.max_num_seqs:
            raise APIError(400, f"n: {params.n} samples per request exceed this server's max_num_seqs "
                           f"({self.max_num_seqs}), the most sequences it runs at once", param="n",
                           code="invalid_value")
        vocab_size = self.engine.vocab_size
        if vocab_size is not None:
            _to_params(lambda: params.check_vocab(vocab_size))
        encoded = await self._encode(prompts, prompt_field)
        for _, token_ids in encoded:
            self._check_context(token_ids, params, vocab_size, prompt_field)
        return encoded

    async def _encode(self, prompts: list[str | list[int]], prompt_field: str) -> list[Encoded]:
        tokenizer = self.tokenizer
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompt token ids instead of text",
                           param=prompt_field, code="invalid_prompt")
        if texts and tokenizer is not None and self.max_model_len is not None:
            longest = max(texts, key=len)
            at_least = tokenizer.min_num_tokens(longest)
            if at_least >= self.max_model_len:
                raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens, but "
                               f"the prompt has at least {at_least} ({len(longest)} characters)",
                               param=prompt_field, code="context_length_exceeded")
        ids: list[list[int]] = []
        if texts and tokenizer is not None:
            try:
                ids = await asyncio.get_running_loop().run_in_executor(None, lambda: [tokenizer.encode(t) for t in texts])
            except Exception as e:  # noqa: BLE001 - text the tokenizer cannot take (a lone surrogate)
                raise APIError(400, f"the prompt could not be tokenized: {e}", param=prompt_field,
                               code="invalid_prompt") from None
        encoded_texts = iter(zip(texts, ids, strict=True))
        return [next(encoded_texts) if isinstance(p, str) else (None, list(p)) for p in prompts]

    def _check_context(self, token_ids: list[int], params: SamplingParams, vocab_size: int | None,
                       prompt_field: str) -> None:
        max_len = self.max_model_len
        if max_len is None or vocab_size is None:
            return
        try:
            check_prompt(token_ids, vocab_size, max_len)
        except RequestError as e:
            code = "context_length_exceeded" if "context length" in str(e) else "invalid_prompt"
            raise APIError(400, str(e), param=prompt_field, code=code) from None
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_len:
            raise APIError(400, f"this model's maximum context length is {max_len} tokens, but the "
                           f"request asks for {len(token_ids) + params.max_tokens} ({len(token_ids)} in the prompt, "
                           f"{params.max_tokens} to generate); shorten the prompt or lower max_tokens",
                           param="max_tokens", code="context_length_exceeded")

    async def _admit(self, request_id: str, prompts: list[Encoded], params: SamplingParams, priority: int,
                     tenant: str) -> list[RequestStream]:
        """One engine request a prompt, admitted together, all or none."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        try:
            return await self.engine.add_requests(ids, prompts, params, priority, tenant)
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDeadError as e:
            raise APIError(500, str(e), type="internal_error", code="engine_dead") from None
        except RequestError as e:
            message = str(e)
            code = "context_length_exceeded" if "context length" in message else "invalid_prompt"
            raise APIError(400, message, code=code) from None
        except ValueError as e:
            raise APIError(400, str(e), param=_field_of(str(e)), code="invalid_value") from None

    async def _collect(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput] | None:
        """Each stream's final output, in order; None if the client went away first."""
        async def finals() -> list[RequestOutput]:
            return [await _last(s) for s in streams]

        collecting = asyncio.ensure_future(finals())
        disconnect = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            done, _ = await asyncio.wait({collecting, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            collecting.cancel()
            disconnect.cancel()
            for s in streams:  # a no-op for a finished one
                if not s.finished:
                    self.engine.abort(s.request_id)
        if collecting not in done:
            return None
        try:
            return collecting.result()
        except EngineDeadError as e:
            raise APIError(500, str(e), type="internal_error", code="engine_dead") from None
        except RequestFailedError as e:
            raise APIError(500, str(e), type="internal_error", code="request_failed") from None

    async def _stream(self, request_id: str, streams: list[RequestStream], n: int, created: int, kind: str,
                      choice: ChoiceBuilder, include_usage: bool, continuous_usage: bool,
                      view: Callable[[RequestOutput], RequestOutput] | None = None) -> AsyncIterator[str]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind

        def event(choices: list[dict[str, Any]], usage: dict[str, int] | None = None,
                  with_usage: bool = include_usage) -> str:
            body: dict[str, Any] = {"id": request_id, "object": chunk_kind, "created": created,
                                    "model": self.model_name, "choices": choices}
            if with_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        last: dict[int, RequestOutput] = {}  # each prompt's latest output
        try:
            async for i, out in _merged(streams):
                if view is not None:
                    out = view(out)
                last[i] = out
                choices = []
                for c in out.outputs:
                    c = numbered(c, i * n)
                    if c.index not in sent_chars:
                        sent_chars[c.index] = sent_tokens[c.index] = 0
                        if kind == "chat.completion":
                            yield event([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}])
                    if sent_tokens[c.index] < 0:  # this sample already finished
                        continue
                    if len(c.text) == sent_chars[c.index] and len(c.token_ids) == sent_tokens[c.index] \
                            and not c.finished:
                        continue
                    choices.append(choice(out, c, sent_chars[c.index], sent_tokens[c.index]))
                    sent_chars[c.index] = len(c.text)
                    sent_tokens[c.index] = -1 if c.finished else len(c.token_ids)
                if choices:
                    yield event(choices, usage_of(last.values()) if continuous_usage else None)
            if include_usage and last:
                yield event([], usage_of(last.values()))
        except (EngineDeadError, RequestFailedError) as e:
            code = "engine_dead" if isinstance(e, EngineDeadError) else "request_failed"
            yield f"data: {json.dumps(APIError(500, str(e), type='internal_error', code=code).body())}\n\n"
        finally:
            for s in streams:
                if not s.finished:  # cancelled: the client went away or the server stops
                    self.engine.abort(s.request_id)
        yield "data: [DONE]\n\n"


async def _last(stream: RequestStream) -> RequestOutput:
    final = None
    async for out in stream:
        final = out
    assert final is not None
    return final


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of every stream as they come, each with its stream's position; the first
    error of any stream is raised. Each stream keeps only its latest output, so neither a slow
    reader nor many prompts make this hold more than one output a stream."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    waiting = {asyncio.ensure_future(s.get()): i for i, s in enumerate(streams)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = waiting.pop(task)
                out = task.result()
                if not out.finished:
                    waiting[asyncio.ensure_future(streams[i].get())] = i
                yield i, out
    finally:
        for task in waiting:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: the first error is the one raised
            task.cancel()


def _field_of(message: str) -> str | None:
    """The field a `ValueError` names: its messages start with `field: ...`."""
    head, sep, _ = message.partition(":")
    return head if sep and head.isidentifier() else None


def _to_params(build: Callable[[], Any]) -> Any:
    try:
        return build()
    except ValueError as e:
        raise APIError(400, str(e), param=_field_of(str(e)), code="invalid_value") from None


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
