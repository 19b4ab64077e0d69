"""Rendering chat templates without blocking the event loop.

The model's own template is the operator's and trusted: it renders in a thread. A template sent
in a request (`chat_template`) is code from a client: Jinja's sandbox keeps it from reaching
Python objects, but not from looping for days or writing gigabytes. It is refused unless the
server runs with `--trust-request-chat-template`, and then rendered in a child process of a fork
server (which has the template module loaded), killed after `RENDER_TIMEOUT_S`; a rendering
longer than the largest prompt the server could receive in a body is refused too.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from multiprocessing.connection import Connection
from typing import Any

from kvpilot.runtime.server.protocol import APIError
from kvpilot.runtime.tokenizer import Tokenizer

RENDER_TIMEOUT_S = 2.0
_TEMPLATES_MODULE = "transformers.utils.chat_template_utils"


async def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                      request_template: str | None, trust_request_template: bool, max_chars: int) -> str:
    """The prompt text of `messages`; raises `APIError` (400) for a template that fails, is not
    trusted, runs too long or renders more than `max_chars`."""
    loop = asyncio.get_running_loop()
    if request_template is None:
        try:
            return await loop.run_in_executor(None, _render_own, tokenizer, messages, add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="no_chat_template" if "no chat template" in str(e)
                           else "invalid_value") from None
        except Exception as e:  # noqa: BLE001 - jinja errors raised by the messages (raise_exception)
            raise APIError(400, f"the chat template could not be applied: {e}", param="messages",
                           code="invalid_value") from None
    if not trust_request_template:
        raise APIError(400, "chat_template: this server does not render chat templates sent in requests "
                       "(start it with --trust-request-chat-template to allow them); leave chat_template out "
                       "to use the model's own", param="chat_template", code="chat_template_not_allowed")
    return await _render_sandboxed(request_template, messages, add_generation_prompt,
                                   tokenizer.hf.special_tokens_map, max_chars)


def _render_own(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([_TEMPLATES_MODULE])
    return ctx


async def _render_sandboxed(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                            special_tokens: dict[str, Any], max_chars: int) -> str:
    loop = asyncio.get_running_loop()
    ctx = _context()
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_render_in_child, name="kvpilot-chat-template", daemon=True,
                       args=(sender, template, messages, add_generation_prompt, special_tokens, max_chars))
    try:
        # starting talks to the fork server (started on first use): not on the event loop
        await loop.run_in_executor(None, proc.start)
        sender.close()
        readable: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)
        loop.add_reader(receiver.fileno(), wake)
        try:
            async with asyncio.timeout(RENDER_TIMEOUT_S):
                await readable
        except TimeoutError:
            raise APIError(400, f"chat_template: rendering took longer than {RENDER_TIMEOUT_S:g} s and was "
                           "stopped", param="chat_template", code="invalid_value") from None
        finally:
            loop.remove_reader(receiver.fileno())
        try:
            reply: tuple[bool, str] = receiver.recv()
        except EOFError:
            raise APIError(400, "chat_template: rendering failed (the renderer exited)", param="chat_template",
                           code="invalid_value") from None
    finally:
        if proc.pid is not None:
            proc.kill()
            await loop.run_in_executor(None, proc.join)
        receiver.close()
    ok, value = reply
    if not ok:
        raise APIError(400, f"chat_template: {value}", param="chat_template", code="invalid_value")
    return value


def _render_in_child(out: Connection, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     special_tokens: dict[str, Any], max_chars: int) -> None:
    """In the child: render as transformers' `apply_chat_template` does (its sandboxed Jinja
    environment, the special tokens as variables) and send back (ok, text or error)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        # (rendered conversations, generation indices), though annotated as str
        result: Any = render_jinja_template(conversations=[messages], chat_template=template,
                                            add_generation_prompt=add_generation_prompt, **special_tokens)
        text = result[0][0]
        if len(text) > max_chars:
            out.send((False, f"the template rendered {len(text)} characters, more than the {max_chars} "
                             "a request may carry"))
        else:
            out.send((True, text))
    except Exception as e:  # noqa: BLE001 - the template's own error, handed back
        out.send((False, f"the chat template could not be applied: {type(e).__name__}: {e}"))
    finally:
        out.close()
