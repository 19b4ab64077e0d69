"""A scale-down kills no request: the builtin autoscaler removes one of two replicas while the
pod it removes streams completions, and every one of those streams ends whole.

The operator (kopf, the pilot, the scaler) runs against the API emulation of
test_operator_lifecycle.py, whose Pods are deleted gracefully as a real API server deletes them
(marked with a deletionTimestamp, removed once their kubelet deletes them again with grace 0).
Each Pod's container is a real `kvpilot serve` (the embedded SmolLM2 on CPU) on a loopback port.
What the control plane and the node would do, and the emulator does not, is played here by three
small stand-ins, each doing only its real counterpart's part in a scale-down:

* `Kubelet` runs a pod of the Deployment's template: the container's command and args (host and
  port moved to a free loopback port, which the Pod object names as its container port, since
  all pods share one IP), its env (the admin token resolved from the Secret; the two variables
  that point into the pod's volumes, the model cache and HOME, keep this machine's values, so the
  converted model is reused). It probes the readiness probe's path at its period and reports Ready
  in the Pod's status. Once the Pod is marked for deletion it runs the container's preStop (a
  sleep), sends SIGTERM, waits for the process to exit until the grace period runs out, sends
  SIGKILL if it has not, and deletes the Pod with grace 0.
* `ReplicaSet` removes pods when the Deployment's replicas fall below them, ranked as the
  ReplicaSet controller ranks them (not Ready first, then the lower pod-deletion-cost, then the
  newer pod); every pod here is Running and Ready, so the deletion cost decides.
* `endpoints` is the Service as the EndpointSlice controller publishes it: Ready pods that are not
  terminating. New requests go through it, as clients reach a Service.

The streams must still be running when SIGTERM comes, so that the drain, not luck, finishes them.
The path from load to SIGTERM is wall time (scrape interval, window, preStop), while generation
speed on a shared CPU varies many-fold from run to run, so the streams' length is sized from the
speed of a warm-up run under the same load; the test asserts that every stream received tokens
after SIGTERM, so a run where that sizing fell short fails instead of passing without a drain.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from file_modules import load_module
from server_harness import free_port

from kvpilot.operator.autoscale import DELETION_COST_ANNOTATION

_lifecycle = load_module(Path(__file__).with_name("test_operator_lifecycle.py"), "_lifecycle")
Cluster, cluster, eventually, operator, NS = (_lifecycle.Cluster, _lifecycle.cluster, _lifecycle.eventually,
                                             _lifecycle.operator, _lifecycle.NS)

POD_PATH = f"/api/v1/namespaces/{NS}/pods"
PROMPT = "Once upon a time, in a small village by the sea,"
REMOVED_STREAMS, KEPT_STREAMS = 3, 7  # the kept pod holds more, by more than the costs' band of 2 requests
SPEC = {
    "model": {"source": "embedded"}, "resources": {"gpus": 0}, "replicas": 2,
    "engine": {"maxModelLen": 2048, "maxNumSeqs": 8, "swapSpace": 0},  # ~30 s of a fast machine's tokens
    "drain": {"preStopSeconds": 1, "gracePeriodSeconds": 90},
    # waitingPerReplica: streams run, none waits, so the load asks for one replica; minReplicas 2
    # holds both until the test lowers it with the streams in flight.
    "autoscaling": {"enabled": True, "mode": "builtin", "metric": "waitingPerReplica", "target": 2,
                    "minReplicas": 2, "maxReplicas": 2, "interval": "1s", "window": "2s",
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}},
}
_VOLUME_ENV = {"KVPILOT_CACHE", "HOME"}


@dataclass
class Termination:
    marked_at: float  # the kubelet saw the deletionTimestamp
    sigterm_at: float | None = None
    exited_at: float | None = None
    returncode: int | None = None
    killed: bool = False


@dataclass
class PodProcess:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    termination: Termination | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Kubelet:
    """The node agent's part in running and terminating pods whose containers are local processes."""

    def __init__(self, cluster: Any, workdir: Path) -> None:
        self.cluster, self.workdir = cluster, workdir
        self.pods: dict[str, PodProcess] = {}
        self.tasks: list[asyncio.Task[None]] = []

    async def run(self, name: str, template: dict[str, Any]) -> PodProcess:
        port = free_port()
        container = template["spec"]["containers"][0]
        args = list(container["args"])
        args[args.index("--host") + 1] = "127.0.0.1"
        args[args.index("--port") + 1] = str(port)
        command = [str(Path(sys.executable).parent / container["command"][0]), *container["command"][1:], *args]
        env = {**os.environ, "PYTHONSAFEPATH": "1"}  # the repo root's operator/ must not shadow the stdlib
        env.update({e["name"]: self._env_value(name, e) for e in container.get("env", [])
                    if e["name"] not in _VOLUME_ENV})
        log = self.workdir / f"{name}.log"
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        pod = PodProcess(name, port, process, log)
        self.pods[name] = pod
        spec = {**template["spec"], "containers": [{**container, "ports": [
            {**container["ports"][0], "containerPort": port}]}]}
        await self.cluster.request("POST", POD_PATH, {
            "apiVersion": "v1", "kind": "Pod", "spec": spec, "status": {"phase": "Pending"},
            "metadata": {"name": name, "namespace": NS, "labels": template["metadata"]["labels"],
                         "annotations": template["metadata"].get("annotations", {})}}, "application/json")
        self.tasks.append(asyncio.create_task(self._lifecycle(pod, container, spec)))
        return pod

    def _env_value(self, pod: str, var: dict[str, Any]) -> str:
        if "value" in var:
            return str(var["value"])
        source = var["valueFrom"]
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name", source
            return pod
        ref = source["secretKeyRef"]
        secret = self.cluster.get("secrets", ref["name"])
        assert secret is not None, f"Secret {ref['name']} for {var['name']}"
        return base64.b64decode(secret["data"][ref["key"]]).decode()

    async def _ready(self, pod: PodProcess, path: str) -> bool:
        try:
            async with self.cluster.session.get(pod.base_url + path,
                                                timeout=aiohttp.ClientTimeout(total=3)) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _report_ready(self, pod: PodProcess, ready: bool) -> None:
        await self.cluster.request("PATCH", f"{POD_PATH}/{pod.name}/status", {"status": {
            "phase": "Running", "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})

    async def _lifecycle(self, pod: PodProcess, container: dict[str, Any], spec: dict[str, Any]) -> None:
        probe = container["readinessProbe"]
        period, threshold, path = probe["periodSeconds"], probe["failureThreshold"], probe["httpGet"]["path"]
        ready, failures, next_probe = False, 0, 0.0
        while True:
            obj = self.cluster.get("pods", pod.name)
            if obj is None or obj["metadata"].get("deletionTimestamp"):
                break
            if time.monotonic() >= next_probe:
                # until the first success the startup phase probes often; then at the probe's period
                ok = await self._ready(pod, path)
                failures = 0 if ok else failures + 1
                if ok != ready and (ok or failures >= threshold):
                    ready = ok
                    await self._report_ready(pod, ready)
                next_probe = time.monotonic() + (period if ready else 0.5)
            await asyncio.sleep(0.05)
        await self._terminate(pod, container, spec)

    async def _terminate(self, pod: PodProcess, container: dict[str, Any], spec: dict[str, Any]) -> None:
        obj = self.cluster.get("pods", pod.name) or {"metadata": {}}
        grace = obj["metadata"].get("deletionGracePeriodSeconds", spec["terminationGracePeriodSeconds"])
        term = pod.termination = Termination(marked_at=time.monotonic())
        deadline = term.marked_at + grace  # preStop counts against the grace period
        await asyncio.sleep(container["lifecycle"]["preStop"]["sleep"]["seconds"])
        pod.process.send_signal(signal.SIGTERM)
        term.sigterm_at = time.monotonic()
        try:
            await asyncio.to_thread(pod.process.wait, max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            term.killed = True
            pod.process.kill()
            await asyncio.to_thread(pod.process.wait)
        term.exited_at, term.returncode = time.monotonic(), pod.process.returncode
        await self.cluster.request("PATCH", f"{POD_PATH}/{pod.name}/status", {"status": {
            "phase": "Succeeded" if term.returncode == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False"}]}})
        await self.cluster.request("DELETE", f"{POD_PATH}/{pod.name}", {"gracePeriodSeconds": 0}, "application/json")

    def all_ready(self) -> bool:
        """Every pod Ready in the Service; a container that died while starting fails the test with its log."""
        for pod in self.pods.values():
            if pod.process.poll() is not None:
                raise AssertionError(f"{pod.name} exited: {pod.log.read_text()[-3000:]}")
        return len(endpoints(self.cluster, self)) == len(self.pods)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for pod in self.pods.values():
            if pod.process.poll() is None:
                pod.process.kill()
                await asyncio.to_thread(pod.process.wait)


class ReplicaSet:
    """The ReplicaSet controller's scale-down: pods beyond the Deployment's replicas, by its ranking."""

    def __init__(self, cluster: Any, name: str) -> None:
        self.cluster, self.name = cluster, name
        self.deleted: list[tuple[str, dict[str, str | None]]] = []  # pod, and every pod's cost then

    def _pods(self) -> list[dict[str, Any]]:
        labels = self.cluster.get("deployments", self.name)["spec"]["selector"]["matchLabels"]
        return [o for k, o in self.cluster.emulator.store.items() if k[2] == "pods" and k[3] == NS
                and labels.items() <= (o["metadata"].get("labels") or {}).items()]

    async def run(self) -> None:
        while True:
            replicas = self.cluster.get("deployments", self.name)["spec"]["replicas"]
            active = [p for p in self._pods() if not p["metadata"].get("deletionTimestamp")]
            if len(active) > replicas:
                costs = {p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(DELETION_COST_ANNOTATION)
                         for p in active}
                for pod in sorted(active, key=_rank)[:len(active) - replicas]:
                    self.deleted.append((pod["metadata"]["name"], costs))
                    await self.cluster.request("DELETE", f"{POD_PATH}/{pod['metadata']['name']}")
            await asyncio.sleep(0.1)


def _rank(pod: dict[str, Any]) -> tuple[bool, int, float]:
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))
    cost = int((pod["metadata"].get("annotations") or {}).get(DELETION_COST_ANNOTATION) or 0)
    created = time.mktime(time.strptime(pod["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ"))
    return ready, cost, -created


def endpoints(cluster: Any, kubelet: Kubelet) -> list[str]:
    """The Service's endpoints: Ready pods that are not terminating."""
    out = []
    for name, pod in sorted(kubelet.pods.items()):
        obj = cluster.get("pods", name)
        if obj is not None and not obj["metadata"].get("deletionTimestamp") and any(
                c["type"] == "Ready" and c["status"] == "True" for c in obj.get("status", {}).get("conditions", [])):
            out.append(pod.base_url)
    return out


@dataclass
class Stream:
    chunk_times: list[float] = field(default_factory=list)  # each chunk that carried a choice
    finish_reason: str | None = None
    completion_tokens: int | None = None
    text: str = ""


async def stream_completion(base_url: str, max_tokens: int, out: Stream | None = None) -> Stream:
    """One streamed completion through the openai client; `out` fills as the chunks come."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    out = out if out is not None else Stream()
    async with client:
        chunks = await client.completions.create(
            model="smol", prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if chunk.choices:
                out.chunk_times.append(time.monotonic())
                out.text += chunk.choices[0].text
                out.finish_reason = chunk.choices[0].finish_reason or out.finish_reason
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
    return out


async def tokens_per_second(removed: PodProcess, kept: PodProcess) -> float:
    """One stream's decode speed on `removed` while both pods hold their test loads (warms them up too)."""
    n = 12
    loads = [stream_completion(removed.base_url, n) for _ in range(REMOVED_STREAMS)]
    loads += [stream_completion(kept.base_url, n) for _ in range(KEPT_STREAMS)]
    measured = (await asyncio.gather(*loads))[:REMOVED_STREAMS]
    return min((len(s.chunk_times) - 1) / (s.chunk_times[-1] - s.chunk_times[0]) for s in measured)


@contextlib.asynccontextmanager
async def running(coro: Any) -> AsyncIterator[asyncio.Task[Any]]:
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _costs(cluster: Any) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name in ("smol-a", "smol-b"):
        value = ((cluster.get("pods", name) or {}).get("metadata", {}).get("annotations") or {}).get(
            DELETION_COST_ANNOTATION)
        out[name] = int(value) if value is not None else None
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_every_stream_of_the_pod_a_scale_down_removes_completes(cluster: Any, tmp_path: Path) -> None:
    kubelet = Kubelet(cluster, tmp_path)
    async with operator():
        await cluster.create_isvc("smol", SPEC)
        deployment = await eventually(functools.partial(cluster.get, "deployments", "smol"), what="the Deployment")
        await eventually(functools.partial(cluster.get, "secrets", "smol-admin"), what="the admin Secret")
        template = deployment["spec"]["template"]
        try:
            kept = await kubelet.run("smol-a", template)
            removed = await kubelet.run("smol-b", template)
            await eventually(kubelet.all_ready, timeout=600, what="both pods Ready")
            await cluster.roll_out("smol")
            rate = await tokens_per_second(removed, kept)
            # ~30 s of generation at the warm-up's speed: many times the load-to-SIGTERM path
            max_tokens = max(24, min(1800, round(30 * rate)))
            replica_set = ReplicaSet(cluster, "smol")
            async with running(replica_set.run()):
                progress = [Stream() for _ in range(REMOVED_STREAMS)]
                streams = [asyncio.create_task(stream_completion(removed.base_url, max_tokens, p)) for p in progress]
                holds = [asyncio.create_task(stream_completion(kept.base_url, max_tokens)) for _ in range(KEPT_STREAMS)]

                # the deletion costs follow the scraped load: the removed pod is the cheaper one
                await eventually(lambda: (c := _costs(cluster))["smol-b"] and c["smol-a"]
                                 and c["smol-a"] > c["smol-b"], timeout=60, what="deletion costs from the streams")
                await eventually(lambda: all(p.chunk_times for p in progress), timeout=120,
                                 what="every stream on smol-b streaming")
                assert not any(s.done() for s in streams), "the streams ended before the scale-down began"
                await cluster.patch_isvc("smol", {"spec": {"autoscaling": {"minReplicas": 1}}})
                await eventually(lambda: replica_set.deleted, timeout=60, what="the ReplicaSet to remove a pod")
                (victim, costs_then), = replica_set.deleted
                for hold in holds:  # they only made smol-a the costlier pod
                    hold.cancel()
                assert victim == "smol-b"
                assert min(costs_then, key=lambda p: int(costs_then[p] or 0)) == "smol-b", costs_then

                await eventually(lambda: removed.termination is not None and removed.termination.sigterm_at,
                                 timeout=30, what="SIGTERM after the preStop sleep")
                assert endpoints(cluster, kubelet) == [kept.base_url]
                await _served_elsewhere_while_draining(cluster, kubelet, removed, kept)
                results = await asyncio.gather(*streams)
            await eventually(lambda: cluster.get("pods", "smol-b") is None, timeout=120,
                             what="the drained pod's exit and its Pod object removed")
        finally:
            await kubelet.stop()

        term = removed.termination
        assert term is not None and term.sigterm_at is not None
        assert term.sigterm_at - term.marked_at >= SPEC["drain"]["preStopSeconds"]  # type: ignore[index]
        assert (term.returncode, term.killed) == (0, False), removed.log.read_text()[-3000:]
        for result in results:
            assert result.finish_reason == "length", result
            assert result.completion_tokens == max_tokens, result
            assert result.chunk_times[-1] > term.sigterm_at, "a stream ended before SIGTERM: nothing was drained"
        assert "draining" in removed.log.read_text()
        assert "drain timeout" not in removed.log.read_text()
        assert cluster.get("deployments", "smol")["spec"]["replicas"] == 1
        status = cluster.get("inferenceservices", "smol")["status"]
        decision = next(d for d in status["decisions"] if d["kind"] == "scale")
        assert (decision["from"], decision["to"]) == ("2", "1")
        assert decision["reason"].startswith("waitingPerReplica ") and decision["reason"].endswith(
            ": 2 -> 1 replicas"), decision


async def _served_elsewhere_while_draining(cluster: Any, kubelet: Kubelet, removed: PodProcess,
                                           kept: PodProcess) -> None:
    """While the removed pod drains, it refuses new work, and requests through the Service are
    all served (by the pod that stays)."""
    async def refusing() -> bool:  # the server has handled its SIGTERM
        async with cluster.session.get(f"{removed.base_url}/ready") as response:
            return response.status == 503
    deadline = time.monotonic() + 10
    while not await refusing():
        assert time.monotonic() < deadline, "/ready still 200 after SIGTERM"
        await asyncio.sleep(0.05)
    async with cluster.session.post(f"{removed.base_url}/v1/completions",
                                    json={"model": "smol", "prompt": PROMPT, "max_tokens": 2}) as response:
        body = await response.json()
        assert response.status == 503 and body["error"]["code"] == "draining", body
    for _ in range(3):
        (url,) = endpoints(cluster, kubelet)
        async with cluster.session.post(f"{url}/v1/completions",
                                        json={"model": "smol", "prompt": PROMPT, "max_tokens": 2}) as response:
            assert response.status == 200, await response.text()
    assert removed.process.poll() is None, "the drain ended before the requests it should not get were sent"
