"""A client for the engine's `GET/POST /admin/config` (runtime/server/admin.py), Bearer-authenticated,
each call within a timeout and retried with exponential backoff while the pod is unreachable,
overloaded (429) or failing (5xx). A refusal (any other 4xx) is final and carries the engine's
own message.

Retrying a POST is safe: the body holds absolute values, so a repeat after a lost answer applies
nothing new. The answer's `config` (what the engine now runs) is therefore the truth to check,
not `applied` (what this particular call changed).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpilot.runtime.tunables import LiveConfig

from .endpoint import PodEndpoint

_RETRIED_STATUSES = {429, 500, 502, 503, 504}


class AdminError(Exception):
    """The engine refused the call (`status` set), or never answered after every attempt."""

    def __init__(self, pod: str, message: str, status: int | None = None) -> None:
        super().__init__(f"pod {pod}: {message}")
        self.pod = pod
        self.status = status


@dataclass(frozen=True)
class AppliedConfig:
    applied: dict[str, dict[str, Any]]  # {name: {"old": ..., "new": ...}} changed by this call
    duration_s: float  # how long the engine took (the pause a live change caused)
    config: LiveConfig  # what the engine runs now
    relayout_pause_s: float | None = None  # a block-size change: the engine's own pause (relayout.pause_ms)


class AdminClient:
    def __init__(self, session: aiohttp.ClientSession, token: str, *, timeout_s: float = 30.0,
                 attempts: int = 4, backoff_s: float = 0.5, max_backoff_s: float = 8.0) -> None:
        if not token:
            raise ValueError("token: the admin token must not be empty")
        if attempts < 1:
            raise ValueError(f"attempts: must be >= 1, not {attempts}")
        if timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"timeout_s and backoff_s: must be positive, not {timeout_s} and {backoff_s}")
        self.session = session
        self._headers = {"Authorization": f"Bearer {token}"}
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    async def get_config(self, endpoint: PodEndpoint) -> LiveConfig:
        return _live_config(endpoint, await self._call("GET", endpoint, None))

    async def apply(self, endpoint: PodEndpoint, changes: Mapping[str, int | str]) -> AppliedConfig:
        """POST the changes; the engine applies them between steps without dropping a request."""
        if not changes:
            raise ValueError("changes: nothing to apply")
        answer = await self._call("POST", endpoint, dict(changes))
        try:
            relayout = answer.get("relayout")
            pause_s = float(relayout["pause_ms"]) / 1e3 if relayout is not None else None
            return AppliedConfig(dict(answer["applied"]), float(answer["duration_s"]),
                                 _live_config(endpoint, answer["config"]), pause_s)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise AdminError(endpoint.pod, f"unexpected answer to POST /admin/config ({e!r}): {answer}") from None

    async def _call(self, method: str, endpoint: PodEndpoint, body: dict[str, Any] | None) -> Any:
        url = endpoint.url("/admin/config")
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            try:
                async with self.session.request(method, url, json=body, headers=self._headers,
                                                timeout=timeout) as response:
                    if response.status in _RETRIED_STATUSES:
                        last = f"HTTP {response.status}: {await _message(response)}"
                        continue
                    if response.status != 200:
                        raise AdminError(endpoint.pod, f"{method} /admin/config answered HTTP {response.status}: "
                                                       f"{await _message(response)}", response.status)
                    text = await response.text()
                try:
                    return json.loads(text)
                except ValueError:
                    raise AdminError(endpoint.pod, f"{method} /admin/config did not answer JSON: {text[:200]}") from None
            except TimeoutError:
                last = f"no answer within {self.timeout_s:g} s"
            except aiohttp.ClientError as e:
                last = f"{type(e).__name__}: {e}"
        raise AdminError(endpoint.pod, f"{method} /admin/config failed {self.attempts} times; last: {last}")


async def _message(response: aiohttp.ClientResponse) -> str:
    """The OpenAI-style error message the server sends, else the start of the body."""
    text = await response.text()
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


def _live_config(endpoint: PodEndpoint, config: Any) -> LiveConfig:
    if not isinstance(config, dict):
        raise AdminError(endpoint.pod, f"the engine's config is not a JSON object: {config!r}")
    try:
        return LiveConfig.from_json(config)
    except (ValueError, TypeError) as e:
        raise AdminError(endpoint.pod, f"the engine reported a config the operator cannot read: {e}") from None
