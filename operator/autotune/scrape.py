"""The scraper: `GET /metrics` from every pod of a service at once, each within a timeout, into
one sliding window per pod. A pod that is unreachable, slow or answers with something that is not
a kvpilot metrics page is skipped and counted (`kvpilot_operator_scrapes_total{result}`); a scrape
pass never fails because of one pod.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import aiohttp

from .. import metrics
from .endpoint import PodEndpoint
from .sample import MetricsError, Sample, parse_metrics
from .window import MetricWindow, WindowSummary

# A kvpilot page is ~20 KiB; anything far larger is not one, and is not read to the end.
MAX_PAGE_BYTES = 4 << 20

Failure = Literal["error", "timeout"]


@dataclass(frozen=True)
class ScrapeFailure:
    pod: str
    result: Failure
    message: str


@dataclass(frozen=True)
class ScrapeReport:
    samples: dict[str, Sample]  # by pod
    failures: tuple[ScrapeFailure, ...]


class ScrapeError(Exception):
    def __init__(self, result: Failure, message: str) -> None:
        super().__init__(message)
        self.result = result


async def fetch_sample(session: aiohttp.ClientSession, endpoint: PodEndpoint, timeout_s: float,
                       clock: Callable[[], float] = time.time) -> Sample:
    """One pod's `/metrics`, parsed; ScrapeError says why not."""
    try:
        async with session.get(endpoint.url("/metrics"), timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                raise ScrapeError("error", f"HTTP {response.status}")
            body = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_PAGE_BYTES:
                    raise ScrapeError("error", f"the page is larger than {MAX_PAGE_BYTES} bytes")
    except TimeoutError:
        raise ScrapeError("timeout", f"no answer within {timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        raise ScrapeError("error", f"{type(e).__name__}: {e}") from None
    try:
        return parse_metrics(body.decode("utf-8"), clock())
    except UnicodeDecodeError:
        raise ScrapeError("error", "the page is not UTF-8 text") from None
    except MetricsError as e:
        raise ScrapeError("error", str(e)) from None


class ServiceScraper:
    """The windows of one InferenceService's pods; `scrape` once per `spec.autotune.interval`.

    Pods missing from a pass's endpoints (deleted, or no longer Ready) lose their window and their
    `kvpilot_operator_live_block_size` series: a pod that comes back starts afresh.
    """

    def __init__(self, namespace: str, name: str, session: aiohttp.ClientSession, *, timeout_s: float,
                 span_s: float, clock: Callable[[], float] = time.time) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be positive, not {timeout_s}")
        self.namespace, self.name = namespace, name
        self.session = session
        self.timeout_s = timeout_s
        self.span_s = span_s
        self.clock = clock
        self.windows: dict[str, MetricWindow] = {}

    async def scrape(self, endpoints: Sequence[PodEndpoint]) -> ScrapeReport:
        pods = {e.pod for e in endpoints}
        for pod in [p for p in self.windows if p not in pods]:
            self._forget(pod)
        results = await asyncio.gather(*(self._scrape_one(e) for e in endpoints))
        samples = {e.pod: r for e, r in zip(endpoints, results, strict=True) if isinstance(r, Sample)}
        failures = tuple(r for r in results if isinstance(r, ScrapeFailure))
        return ScrapeReport(samples, failures)

    def summaries(self, since: float | None = None, until: float | None = None) -> dict[str, WindowSummary]:
        """Each pod's summary over (since, until]; pods with too few samples are left out."""
        out = {pod: w.summarize(since, until) for pod, w in self.windows.items()}
        return {pod: s for pod, s in out.items() if s is not None}

    def close(self) -> None:
        """The service is gone: drop every window and metric series."""
        for pod in list(self.windows):
            self._forget(pod)

    async def _scrape_one(self, endpoint: PodEndpoint) -> Sample | ScrapeFailure:
        try:
            sample = await fetch_sample(self.session, endpoint, self.timeout_s, self.clock)
        except ScrapeError as e:
            metrics.SCRAPES.labels(self.namespace, self.name, e.result).inc()
            return ScrapeFailure(endpoint.pod, e.result, str(e))
        metrics.SCRAPES.labels(self.namespace, self.name, "ok").inc()
        metrics.LIVE_BLOCK_SIZE.labels(self.namespace, self.name, endpoint.pod).set(sample.settings.block_size)
        self.windows.setdefault(endpoint.pod, MetricWindow(endpoint.pod, self.span_s)).add(sample)
        return sample

    def _forget(self, pod: str) -> None:
        del self.windows[pod]  # a window exists only after a good scrape, which set the series
        metrics.LIVE_BLOCK_SIZE.remove(self.namespace, self.name, pod)
