"""The load generator: sends requests to any OpenAI-compatible server over HTTP, streaming, on an
arrival schedule, and times every token. `kvpilot bench serve` and `kvpilot bench autotune` both
drive servers through `run_load`.

Arrivals follow vLLM's benchmark: the gaps between requests are Gamma-distributed with shape
`burstiness` and mean 1 / rate, so burstiness 1 is a Poisson process and smaller values bunch
requests into bursts; rate inf sends everything at once. `max_concurrency` caps the requests in
flight: an arrival waits for a free slot (its latency still counts from when it was sent).

Each request is a streaming `/v1/completions` call (prompt token ids or text, greedy, with
`stream_options.include_usage`). TTFT is the time to the first chunk that carries a choice; each
later chunk's gap is one inter-token latency (ITL), as vLLM's benchmark counts them; the number
of output tokens is the final usage chunk's, else the number of chunks.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from .workload import BenchRequest


@dataclass(frozen=True)
class LoadConfig:
    base_url: str  # the server's root, e.g. http://127.0.0.1:8000
    model: str
    request_rate: float = math.inf  # requests/s; inf sends all at once
    burstiness: float = 1.0  # Gamma shape of the gaps: 1 is Poisson, < 1 bursty
    max_concurrency: int | None = None
    api_key: str | None = None
    ignore_eos: bool = False
    timeout_s: float = 600.0  # per request
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be positive, not {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness: must be positive, not {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, not {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be positive, not {self.timeout_s}")


@dataclass
class RequestResult:
    sent_s: float  # when it was sent, seconds from the run's start
    prompt_len: int | None
    output_len: int = 0  # tokens generated
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class LoadResult:
    results: list[RequestResult]  # in the order of the requests
    duration_s: float  # first send to last answer
    started_at: float  # wall clock (time.time()) at the run's start


def arrival_times(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start: cumulative Gamma gaps with mean 1 / rate."""
    if math.isinf(rate):
        return np.zeros(count)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def run_load(config: LoadConfig, requests: Sequence[BenchRequest],
                   progress: Callable[[int], object] | None = None,
                   arrivals: Sequence[float] | None = None) -> LoadResult:
    """Send `requests` at `arrivals` (seconds from the start; default: drawn from the config's
    rate and burstiness) and wait for every answer. Failures are recorded, never raised."""
    if arrivals is None:
        arrivals = arrival_times(len(requests), config.request_rate, config.burstiness,
                                 np.random.default_rng(config.seed)).tolist()
    if len(arrivals) != len(requests):
        raise ValueError(f"arrivals: {len(arrivals)} times for {len(requests)} requests")
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    url = config.base_url.rstrip("/") + "/v1/completions"
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as session:
        started_at, start = time.time(), time.perf_counter()

        async def one(request: BenchRequest, at: float) -> RequestResult:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is None:
                result = await _send(session, url, config, request, start)
            else:
                async with slots:
                    result = await _send(session, url, config, request, start)
            if progress is not None:
                progress(1)
            return result

        results = await asyncio.gather(*(one(r, float(t)) for r, t in zip(requests, arrivals, strict=True)))
        duration = time.perf_counter() - start
    return LoadResult(list(results), duration, started_at)


async def _send(session: aiohttp.ClientSession, url: str, config: LoadConfig, request: BenchRequest,
                start: float) -> RequestResult:
    body: dict[str, object] = {
        "model": config.model, "prompt": request.prompt, "max_tokens": request.output_len,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    sent = time.perf_counter()
    result = RequestResult(sent - start, request.prompt_len)
    last = sent
    chunks, texts = 0, []
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {_message(await response.text())}"
                return result
            async for raw in response.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {_message(data)}"
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft_s is None:
                        result.ttft_s = now - sent
                    else:
                        result.itls_s.append(now - last)
                    last = now
                    chunks += 1
                    texts.append(chunk["choices"][0].get("text") or "")
                usage = chunk.get("usage")
                if usage:
                    result.output_len = int(usage.get("completion_tokens", 0))
                    if result.prompt_len is None:
                        result.prompt_len = int(usage.get("prompt_tokens", 0))
    except TimeoutError:
        result.error = f"no complete answer within {config.timeout_s:g} s"
        return result
    except (aiohttp.ClientError, ValueError, UnicodeDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if result.ttft_s is None:
        result.error = "the stream ended without a token"
        return result
    result.e2e_s = last - sent
    result.output_len = result.output_len or chunks
    result.text = "".join(texts)
    return result


def _message(text: str) -> str:
    """The OpenAI error message in a body, else the body's start."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]
