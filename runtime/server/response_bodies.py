"""OpenAI response bodies, built in the API process from a request's `RequestOutput`: each
endpoint's choices (chat: a message or a delta; completions: text, with `echo` and prompt
logprobs), their logprobs in each API's shape, and the usage object. `sent_chars`/`sent_tokens`
say how much of a completion earlier chunks of a stream carried (0 for a whole response).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from kvpilot.runtime.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from kvpilot.runtime.tokenizer import Tokenizer


def chat_choice(c: CompletionOutput, sent_chars: int, sent_tokens: int, top: int, stream: bool,
                tokenizer: Tokenizer | None) -> dict[str, Any]:
    logprobs = None
    if c.logprobs is not None:
        logprobs = {"content": [_chat_logprob(t, lp, top, tokenizer)
                                for t, lp in zip(c.token_ids[sent_tokens:], c.logprobs[sent_tokens:], strict=False)]}
    text = c.text[sent_chars:]
    body: dict[str, Any] = {"index": c.index, "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason}
    if stream:
        body["delta"] = {"content": text} if text or not c.finished else {}
    else:
        body["message"] = {"role": "assistant", "content": text}
    return body


def _chat_logprob(token_id: int, entry: dict[int, Any], top: int, tokenizer: Tokenizer | None) -> dict[str, Any]:
    token = _token_text(token_id, tokenizer)
    ranked = sorted((lp for lp in entry.items() if lp[1].rank <= top), key=lambda kv: kv[1].rank)
    return {"token": token, "logprob": _finite(entry[token_id].logprob), "bytes": list(token.encode()),
            "top_logprobs": [{"token": (t := _token_text(tid, tokenizer)), "logprob": _finite(lp.logprob),
                              "bytes": list(t.encode())} for tid, lp in ranked]}


def completion_choice(out: RequestOutput, c: CompletionOutput, sent_chars: int, sent_tokens: int,
                      tokenizer: Tokenizer | None, echo: str | None = None, echo_logprobs: int | None = None,
                      prompt_logprobs: int | None = None) -> dict[str, Any]:
    """`echo`: the prompt's text, put before the completion's first chunk (with its logprobs,
    the first token's null, when `echo_logprobs` is set); `prompt_logprobs` (vLLM's field),
    in the first chunk too."""
    first = sent_chars == sent_tokens == 0
    offset = sent_chars + (len(echo) if echo is not None else 0)
    echo = echo if first else None
    logprobs = None
    if c.logprobs is not None:
        logprobs = _completion_logprobs(c.token_ids[sent_tokens:], c.logprobs[sent_tokens:], offset, tokenizer)
    if echo is not None and echo_logprobs is not None and out.prompt_logprobs is not None:
        prompt = _completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, 0, tokenizer, echo_logprobs)
        logprobs = prompt if logprobs is None else {key: prompt[key] + logprobs[key] for key in prompt}
    body = {"index": c.index, "text": (echo or "") + c.text[sent_chars:], "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if prompt_logprobs is not None and first:
        body["prompt_logprobs"] = [None if entry is None else {
            str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": _token_text(tid, tokenizer)}
            for tid, lp in entry.items() if tid == token or lp.rank <= prompt_logprobs}
            for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=False)]
    return body


def _completion_logprobs(token_ids: list[int], logprobs: SampleLogprobs | PromptLogprobs, offset: int,
                         tokenizer: Tokenizer | None, top: int | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs of `token_ids` (an entry of None, the prompt's first token, is
    null); each top list holds the token and the alternatives ranked up to `top` (all: None)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        token = _token_text(token_id, tokenizer)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(_finite(entry[token_id].logprob))
        tops.append({_token_text(t, tokenizer): _finite(lp.logprob) for t, lp in
                     sorted(entry.items(), key=lambda kv: kv[1].rank)
                     if top is None or t == token_id or lp.rank <= top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_text(prompt: str | list[int], tokenizer: Tokenizer | None) -> str:
    """What `echo` shows of a prompt: its text as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        return "".join(_token_text(t, tokenizer) for t in prompt)
    return tokenizer.decode(prompt, skip_special_tokens=False)


def _token_text(token_id: int, tokenizer: Tokenizer | None) -> str:
    if tokenizer is None:
        return f"<{token_id}>"
    return tokenizer.convert_id(token_id)


def without_generated(out: RequestOutput) -> RequestOutput:
    """`out` with its completions' tokens left out (`echo` with `max_tokens: 0`: the engine ran one)."""
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                            cumulative_logprob=None if c.cumulative_logprob is None else 0.0)
        for c in out.outputs])


def numbered(c: CompletionOutput, offset: int) -> CompletionOutput:
    """`c` as choice `offset + c.index` of a request with several prompts."""
    return dataclasses.replace(c, index=c.index + offset) if offset else c


def usage_of(outs: Iterable[RequestOutput]) -> dict[str, int]:
    prompt = completion = 0
    for out in outs:
        prompt += len(out.prompt_token_ids)
        completion += sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finite(value: float) -> float:
    """JSON has no -inf: clamp it as OpenAI-compatible servers do."""
    return max(value, -9999.0)
