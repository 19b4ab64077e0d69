"""The server's own view of a load run: `/metrics` scraped every 0.5 s while the load runs,
parsed with prometheus_client's parser, and averaged. The names are vLLM's, which kvpilot also
exports, so a vLLM server gives them too; a server without them gives none.

Per run: `kv_cache_usage` (0-1), `num_requests_waiting`, `num_requests_running` (means over the
scrapes) and `preemptions_per_s` (the counter's increase over the scrapes' span): the signals the
autoscaler reads, which is why the capacity curve carries them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

_GAUGES = {"vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:num_requests_waiting": "num_requests_waiting",
           "vllm:num_requests_running": "num_requests_running"}
_PREEMPTIONS = "vllm:num_preemptions_total"


def parse_page(text: str) -> dict[str, float]:
    """The gauges and the preemption counter on one page, summed over label sets."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _GAUGES:
                key = _GAUGES[sample.name]
            elif sample.name == _PREEMPTIONS:
                key = "preemptions"
            else:
                continue
            values[key] = values.get(key, 0.0) + sample.value
    return values


class GaugeSampler:
    """`async with GaugeSampler(url):` scrapes while the block runs; `.summary()` afterwards."""

    def __init__(self, base_url: str, interval_s: float = 0.5, api_key: str | None = None) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> GaugeSampler:
        self._session = aiohttp.ClientSession(headers=self.headers)
        await self._scrape()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *_: Any) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        await self._scrape()
        await self._session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._scrape()

    async def _scrape(self) -> None:
        try:
            async with self._session.get(self.url, timeout=aiohttp.ClientTimeout(total=5)) as response:
                if response.status != 200:
                    self.failures += 1
                    return
                text = await response.text()
            self.samples.append((time.perf_counter(), parse_page(text)))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.failures += 1

    def summary(self) -> dict[str, float]:
        """Means of the gauges the pages carried and the preemption rate; {} for a server that
        exposes none of them."""
        out: dict[str, float] = {}
        # the first scrape comes before any load: it counts for the preemption baseline only
        during = self.samples[1:]
        for key in _GAUGES.values():
            seen = [values[key] for _, values in during if key in values]
            if seen:
                out[key] = sum(seen) / len(seen)
        counted = [(t, values["preemptions"]) for t, values in self.samples if "preemptions" in values]
        if len(counted) >= 2 and counted[-1][0] > counted[0][0]:
            out["preemptions_per_s"] = max(0.0, counted[-1][1] - counted[0][1]) / (counted[-1][0] - counted[0][0])
        return out
