"""The scraper and the admin client against a real `kvpilot serve` (the embedded model on CPU, one
process for the module) on loopback, beside endpoints that are closed, slow or not kvpilot."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web
from prometheus_client import REGISTRY
from server_harness import free_port

from kvpilot.operator.autotune import (
    AdminClient,
    AdminError,
    LiveConfig,
    PodEndpoint,
    ServiceScraper,
)

KVPILOT = str(Path(sys.executable).parent / "kvpilot")
TOKEN = "admin-token-for-tests"


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodEndpoint]:
    port = free_port()
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w")
    env = {**os.environ, "PYTHONSAFEPATH": "1", "KVPILOT_ADMIN_TOKEN": TOKEN}
    proc = subprocess.Popen([KVPILOT, "serve", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
                             "--max-num-seqs", "4", "--swap-space", "0.25", "--disable-log-stats"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"kvpilot serve exited early; see {log.name}"
            assert time.monotonic() < deadline, "kvpilot serve did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield PodEndpoint("serve-0", "127.0.0.1", port)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def closed_endpoint(pod: str) -> PodEndpoint:
    return PodEndpoint(pod, "127.0.0.1", free_port())  # nothing listens there


def scrapes(name: str, result: str) -> float:
    value = REGISTRY.get_sample_value("kvpilot_operator_scrapes_total",
                                      {"namespace": "tests", "name": name, "result": result})
    return value or 0.0


def live_block_size(name: str, pod: str) -> float | None:
    return REGISTRY.get_sample_value("kvpilot_operator_live_block_size",
                                     {"namespace": "tests", "name": name, "pod": pod})


def counting_session() -> tuple[aiohttp.ClientSession, list[str]]:
    """A session that records every request it starts (aiohttp's own tracing hooks)."""
    started: list[str] = []

    async def on_start(_session: object, _ctx: object, params: aiohttp.TraceRequestStartParams) -> None:
        started.append(str(params.url))

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    return aiohttp.ClientSession(trace_configs=[trace]), started


async def test_windows_count_what_the_pod_served_and_a_closed_endpoint_is_skipped(
        pod: PodEndpoint, session: aiohttp.ClientSession) -> None:
    scraper = ServiceScraper("tests", "served", session, timeout_s=10, span_s=600)
    endpoints = [pod, closed_endpoint("gone-0")]
    first = await scraper.scrape(endpoints)
    assert set(first.samples) == {"serve-0"}
    assert [(f.pod, f.result) for f in first.failures] == [("gone-0", "error")]
    assert first.samples["serve-0"].settings.block_size == 16
    assert live_block_size("served", "serve-0") == 16

    client = openai.AsyncOpenAI(base_url=pod.url("/v1"), api_key="unused", max_retries=0)
    answers = await asyncio.gather(*(client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=f"Count to {n}:", max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True}) for n in (3, 5, 7)))
    await scraper.scrape(endpoints)

    assert (scrapes("served", "ok"), scrapes("served", "error")) == (2, 2)
    assert set(scraper.windows) == {"serve-0"}
    s = scraper.summaries()["serve-0"]
    assert s.num_requests == 3 and s.ttft.count == 3 and s.itl.count == 3 * 3
    assert s.generation_tokens_per_s * s.duration_s == pytest.approx(12)
    assert s.prompt_tokens_per_s * s.duration_s == pytest.approx(sum(a.usage.prompt_tokens for a in answers))
    assert s.num_restarts == 0 and not s.settings_changed and s.settings.preemption_mode == "recompute"

    await scraper.scrape([])  # the pod left the service
    assert scraper.windows == {} and live_block_size("served", "serve-0") is None


async def test_slow_and_foreign_endpoints_are_skipped_and_counted_while_the_pod_is_read(
        pod: PodEndpoint, session: aiohttp.ClientSession) -> None:
    app = web.Application()
    app.router.add_get("/metrics", lambda _request: web.Response(text="<html>a web page</html>"))
    runner = web.AppRunner(app)
    await runner.setup()
    foreign_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", foreign_port).start()

    open_now, most_open, release = 0, 0, asyncio.Event()

    async def never_answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now, most_open
        open_now += 1
        most_open = max(most_open, open_now)
        await release.wait()
        open_now -= 1
        writer.close()

    slow = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    slow_port = slow.sockets[0].getsockname()[1]
    try:
        scraper = ServiceScraper("tests", "mixed", session, timeout_s=1.0, span_s=600)
        report = await scraper.scrape([pod, PodEndpoint("foreign-0", "127.0.0.1", foreign_port),
                                       PodEndpoint("slow-0", "127.0.0.1", slow_port),
                                       PodEndpoint("slow-1", "127.0.0.1", slow_port)])
    finally:
        release.set()
        slow.close()
        await runner.cleanup()
    assert set(report.samples) == {"serve-0"}
    failures = {f.pod: (f.result, f.message) for f in report.failures}
    assert failures["foreign-0"][0] == "error" and "not Prometheus text" in failures["foreign-0"][1]
    assert failures["slow-0"] == ("timeout", "no answer within 1 s") == failures["slow-1"]
    assert most_open == 2  # both slow pods were waited on at once, not one after the other
    assert [scrapes("mixed", r) for r in ("ok", "error", "timeout")] == [1, 1, 2]


async def test_the_admin_client_applies_a_change_the_metrics_then_show(
        pod: PodEndpoint, session: aiohttp.ClientSession) -> None:
    admin = AdminClient(session, TOKEN, timeout_s=60)
    before = await admin.get_config(pod)
    assert before == LiveConfig(16, "recompute", 4, before.max_num_batched_tokens, "fcfs")
    scraper = ServiceScraper("tests", "applied", session, timeout_s=10, span_s=600)
    await scraper.scrape([pod])
    try:
        result = await admin.apply(pod, {"block_size": 8, "preemption_mode": "swap"})
        assert result.applied == {"block_size": {"old": 16, "new": 8},
                                  "preemption_mode": {"old": "recompute", "new": "swap"}}
        assert result.config == LiveConfig(8, "swap", 4, before.max_num_batched_tokens, "fcfs")
        assert result.duration_s >= 0
        # the engine's own account of the block-size change's pause, within the call's duration
        assert result.relayout_pause_s is not None and 0 <= result.relayout_pause_s <= result.duration_s
        assert await admin.get_config(pod) == result.config
        report = await scraper.scrape([pod])
        assert report.samples["serve-0"].settings.config == result.config  # every tunable, as the pod runs it
        assert live_block_size("applied", "serve-0") == 8
        again = await admin.apply(pod, {"block_size": 8, "preemption_mode": "swap"})
        assert again.applied == {} and again.config == result.config  # a repeated POST changes nothing
        assert again.relayout_pause_s is None  # and re-lays nothing
        limits = await admin.apply(pod, {"max_num_seqs": 2, "max_num_batched_tokens": 512})
        report = await scraper.scrape([pod])
        assert report.samples["serve-0"].settings.config == limits.config == \
            LiveConfig(8, "swap", 2, 512, "fcfs")  # a batch limit alone shows too
    finally:
        await admin.apply(pod, before.to_json())


async def test_a_refused_change_fails_at_once_with_the_engine_s_message(pod: PodEndpoint) -> None:
    counted, started = counting_session()
    async with counted:
        admin = AdminClient(counted, TOKEN, attempts=4, backoff_s=0.01)
        with pytest.raises(AdminError, match="block_size") as refused:
            await admin.apply(pod, {"block_size": 12})
        assert refused.value.status == 400 and len(started) == 1
        with pytest.raises(AdminError) as unauthorized:
            await AdminClient(counted, "wrong-token", attempts=4, backoff_s=0.01).get_config(pod)
        assert unauthorized.value.status == 401 and len(started) == 2
        assert "wrong-token" not in str(unauthorized.value)


async def test_an_unreachable_pod_is_retried_then_reported() -> None:
    counted, started = counting_session()
    async with counted:
        admin = AdminClient(counted, TOKEN, attempts=3, backoff_s=0.01)
        with pytest.raises(AdminError, match="failed 3 times; last: ClientConnectorError") as error:
            await admin.apply(closed_endpoint("gone-0"), {"block_size": 8})
    assert error.value.status is None and len(started) == 3


async def test_an_overloaded_answer_is_retried_until_the_engine_answers(
        pod: PodEndpoint, session: aiohttp.ClientSession) -> None:
    """A front that answers 503 twice, then passes the call on to the real engine."""
    calls = 0

    async def front(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls <= 2:
            return web.json_response({"error": {"message": "server is draining"}}, status=503)
        async with session.get(pod.url("/admin/config"), headers={"Authorization": request.headers["Authorization"]}) as r:
            return web.json_response(await r.json(), status=r.status)

    app = web.Application()
    app.router.add_get("/admin/config", front)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        config = await AdminClient(session, TOKEN, attempts=3, backoff_s=0.01).get_config(
            PodEndpoint("serve-0", "127.0.0.1", port))
        assert config.block_size == 16 and calls == 3
        calls = 0
        with pytest.raises(AdminError, match="failed 2 times; last: HTTP 503: server is draining"):
            await AdminClient(session, TOKEN, attempts=2, backoff_s=0.01).get_config(
                PodEndpoint("serve-0", "127.0.0.1", port))
    finally:
        await runner.cleanup()
