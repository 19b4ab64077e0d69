"""The pilot loop of the real operator (kopf, work queue, controller, pilot) against the API
emulation of test_operator_lifecycle.py, with Pod objects whose IPs point at engine stand-ins on
loopback.

Each stand-in (tests/support/engine_pods.py) serves what a `kvpilot serve` pod serves to the
operator and nothing else: a real server with a burst that queues over a hundred requests takes
minutes on two cores. The last test drives a real `kvpilot serve` (the embedded model on CPU)
through a canary instead.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp.web
import pytest
from engine_pods import RELAYOUT_PAUSE_MS, EnginePod, serve
from file_modules import load_module
from prometheus_client import REGISTRY

_lifecycle = load_module(Path(__file__).with_name("test_operator_lifecycle.py"), "_lifecycle")
Cluster, cluster, eventually, operator, NS = (_lifecycle.Cluster, _lifecycle.cluster, _lifecycle.eventually,
                                             _lifecycle.operator, _lifecycle.NS)
SELECTOR = {"app.kubernetes.io/name": "kvpilot", "serving.kvpilot.io/inferenceservice": "smol"}
FAST_TUNING = {"enabled": True, "interval": "1s", "cooldown": "1s", "minDwell": "1s",
               "canary": {"window": "1s", "timeout": "30s", "minRequests": 1}}


@pytest.fixture(autouse=True)
def _fresh_operator_metrics() -> None:
    """Series of earlier tests' services would mix with these."""
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001
        if hasattr(collector, "_metrics") and hasattr(collector, "_labelnames"):
            collector.clear()


@pytest.fixture
async def pods(cluster: Any) -> AsyncIterator[Any]:
    """`await pods(n)`: n engine stand-ins and their Ready Pod objects (once the admin Secret exists)."""
    runners: list[aiohttp.web.AppRunner] = []

    async def start(names: list[str]) -> dict[str, EnginePod]:
        secret = await eventually(functools.partial(cluster.get, "secrets", "smol-admin"), what="the admin Secret")
        token = base64.b64decode(secret["data"]["token"]).decode()
        started = {}
        for name in names:
            pod = EnginePod(token)
            runner, port = await serve(pod)
            runners.append(runner)
            await cluster.request("POST", f"/api/v1/namespaces/{NS}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": SELECTOR},
                "spec": {"containers": [{"name": "server", "image": "kvpilot:test",
                                         "ports": [{"name": "http", "containerPort": port}]}]},
                "status": {"phase": "Running", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "True"}]}}, "application/json")
            started[name] = pod
        return started

    yield start
    for runner in runners:
        await runner.cleanup()


def _status(cluster: Any) -> dict[str, Any]:
    return (cluster.get("inferenceservices", "smol") or {}).get("status", {})


def _reasons(cluster: Any) -> list[str]:
    return [reason for _, reason, _ in cluster.events("smol")]


async def test_a_burst_switches_the_config_through_a_canary_and_the_calm_switches_it_back(
        cluster: Any, pods: Any) -> None:
    spec = {"model": {"source": "embedded"}, "resources": {"gpus": 1}, "replicas": 2,
            "engine": {"swapSpace": 1}, "autotune": FAST_TUNING}
    async with operator():
        await cluster.create_isvc("smol", spec)
        engines = await pods(["smol-a", "smol-b"])
        await cluster.roll_out("smol")
        for engine in engines.values():
            engine.waiting = 150  # above queueDepthHigh 100: pressure

        await eventually(lambda: all(e.settings == (8, "swap") for e in engines.values()), timeout=40,
                         what="both pods on the pressure config")
        canary_pod = next(p for p, e in engines.items() if e.posts)
        await eventually(lambda: "TuningPromoted" in _reasons(cluster), what="the TuningPromoted Event")
        assert "TuningCanary" in _reasons(cluster)
        await eventually(lambda: _status(cluster).get("tuning", {}).get("config", {}).get("blockSize") == 8,
                         what="status.tuning.config")
        status = _status(cluster)
        assert status["tuning"]["config"]["preemptionMode"] == "swap"
        assert status["engine"]["blockSize"] == 8 and status["engine"]["preemptionMode"] == "swap"
        assert any(c["type"] == "Tuned" and c["status"] == "True" and c["reason"] == "Promoted"
                   for c in status["conditions"])
        kinds = [d["reason"].split(":")[0] for d in status["decisions"]]
        assert kinds[:2] == [f"canary on pod {canary_pod}", f"promoted from pod {canary_pod}"]
        assert status["decisions"][0]["metrics"]["queueDepth"] == 150
        tuned = await eventually(functools.partial(cluster.get, "configmaps", "smol-tuned"), what="the ConfigMap")
        await eventually(lambda: json.loads(cluster.get("configmaps", "smol-tuned")["data"]["tuned.json"])
                         .get("block_size") == 8, what="the tuned config in the ConfigMap")
        assert tuned["metadata"]["ownerReferences"][0]["name"] == "smol"
        args = cluster.get("deployments", "smol")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[-2:] == ["--tuned-config", "/etc/kvpilot/tuned/tuned.json"]

        engines["smol-b"].restart()  # came back on its flags' config, the other untouched
        posts_a = len(engines["smol-a"].posts)
        await eventually(lambda: engines["smol-b"].settings == (8, "swap"), timeout=20,
                         what="the restarted pod brought back to the tuned config")
        assert len(engines["smol-a"].posts) == posts_a
        await eventually(lambda: "TuningConverged" in _reasons(cluster), what="the TuningConverged Event")

        for engine in engines.values():
            engine.waiting = 0  # below queueDepthLow 50 with no preemptions: calm
        await eventually(lambda: all(e.settings == (16, "recompute") for e in engines.values()), timeout=40,
                         what="both pods back on the calm config")
        await eventually(lambda: _status(cluster).get("tuning", {}).get("config", {}).get("blockSize") == 16,
                         what="status.tuning.config back to 16")


async def test_after_an_operator_restart_the_tuned_config_in_status_is_kept_and_pods_are_brought_to_it(
        cluster: Any, pods: Any) -> None:
    spec = {"model": {"source": "embedded"}, "resources": {"gpus": 1}, "replicas": 1,
            "engine": {"swapSpace": 1}, "autotune": FAST_TUNING}
    tuned = {"blockSize": 8, "preemptionMode": "swap", "maxNumSeqs": 256, "maxNumBatchedTokens": 2048,
             "schedulerPolicy": "fcfs"}
    await cluster.request("POST", _lifecycle.IS_PATH, {
        "apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "smol", "namespace": NS}, "spec": spec,
        "status": {"tuning": {"config": tuned, "lastChangeTime": "2026-01-01T00:00:00Z"}}}, "application/json")
    async with operator():  # as if it had tuned the service before it restarted
        engines = await pods(["smol-a"])
        engines["smol-a"].waiting = 150  # the pressure the tuned config is for
        await eventually(lambda: engines["smol-a"].settings == (8, "swap"), timeout=20,
                         what="the pod brought to the tuned config")
        await eventually(lambda: "TuningConverged" in _reasons(cluster), what="the TuningConverged Event")
        assert "TuningCanary" not in _reasons(cluster)
        assert _status(cluster)["tuning"]["config"] == tuned
        await eventually(lambda: json.loads((cluster.get("configmaps", "smol-tuned") or {"data": {"tuned.json": "{}"}})
                                            ["data"]["tuned.json"]).get("block_size") == 8, what="the ConfigMap")

def _outcome(status: dict[str, Any], block_size: int, mode: str) -> dict[str, Any] | None:
    rows = status.get("tuning", {}).get("outcomes") or []
    return next((r for r in rows if (r["blockSize"], r["preemptionMode"]) == (block_size, mode)), None)


async def test_what_the_tuner_measured_and_the_tuned_config_survive_an_operator_restart(
        cluster: Any, pods: Any) -> None:
    spec = {"model": {"source": "embedded"}, "resources": {"gpus": 1}, "replicas": 1,
            "engine": {"swapSpace": 1}, "autotune": FAST_TUNING}
    async with operator():
        await cluster.create_isvc("smol", spec)
        engines = await pods(["smol-a"])
        engines["smol-a"].waiting = 150  # pressure: 8/swap is tried, promoted and measured saturated
        await eventually(lambda: "TuningPromoted" in _reasons(cluster), timeout=40, what="the TuningPromoted Event")
        await eventually(lambda: (_outcome(_status(cluster), 8, "swap") or {}).get("windows", 0) >= 2,
                         what="8/swap's measured outcome in status.tuning.outcomes")
    before = _status(cluster)["tuning"]
    assert before["config"]["blockSize"] == 8 and before["config"]["preemptionMode"] == "swap"
    assert "canary" not in before  # promoted: no change is being tried
    assert before["switchPauses"] == [{"from": {"blockSize": 16, "preemptionMode": "recompute"},
                                       "to": {"blockSize": 8, "preemptionMode": "swap"},
                                       "pauseMs": RELAYOUT_PAUSE_MS, "switches": 1}]
    measured = _outcome(_status(cluster), 8, "swap")
    assert measured is not None and measured["tokensPerSecond"] > 0
    posts, canaries = len(engines["smol-a"].posts), _reasons(cluster).count("TuningCanary")

    seen: list[int] = []  # 8/swap's windows in status at every look: a fresh memory would start over at 1

    def added_to() -> bool:
        seen.append((_outcome(_status(cluster), 8, "swap") or {}).get("windows", 0))
        return seen[-1] > measured["windows"] + 1

    async with operator():  # a new operator process: only status remembers
        await eventually(added_to, what="the restarted operator adding to the reloaded outcome")
        assert min(seen) >= measured["windows"], seen
        after = _status(cluster)["tuning"]
        grown = _outcome(_status(cluster), 8, "swap")
        assert grown is not None and grown["seconds"] > measured["seconds"]
        assert after["config"] == before["config"] and after["switchPauses"] == before["switchPauses"]
        assert engines["smol-a"].settings == (8, "swap") and len(engines["smol-a"].posts) == posts
        assert _reasons(cluster).count("TuningCanary") == canaries


async def test_a_restarted_operator_acts_on_the_outcomes_in_status_instead_of_trying_again(
        cluster: Any, pods: Any) -> None:
    """Status says that on this service every other configuration got through fewer tokens at
    capacity than 16/recompute: a burst does not send it to the article's 8/swap again."""
    spec = {"model": {"source": "embedded"}, "resources": {"gpus": 1}, "replicas": 1,
            "engine": {"swapSpace": 1}, "autotune": FAST_TUNING}
    tuned = {"blockSize": 16, "preemptionMode": "recompute", "maxNumSeqs": 256, "maxNumBatchedTokens": 2048,
             "schedulerPolicy": "fcfs"}
    outcomes = [{"blockSize": b, "preemptionMode": m, "maxNumSeqs": 256, "maxNumBatchedTokens": 2048,
                 "tokensPerSecond": rate, "spread": 10.0, "seconds": 120.0, "windows": 12}
                for b, m, rate in ((8, "recompute", 650.0), (8, "swap", 600.0), (16, "recompute", 1000.0),
                                   (16, "swap", 700.0))]
    await cluster.request("POST", _lifecycle.IS_PATH, {
        "apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "smol", "namespace": NS}, "spec": spec,
        "status": {"tuning": {"config": tuned, "lastChangeTime": "2026-01-01T00:00:00Z", "outcomes": outcomes}}},
        "application/json")
    async with operator():
        engines = await pods(["smol-a"])
        engines["smol-a"].waiting = 150
        await eventually(lambda: "the best measured" in next(
            (c["message"] for c in _status(cluster).get("conditions", []) if c["type"] == "Tuned"), ""),
            timeout=20, what="a decision on the reloaded outcomes")
        tuned_condition = next(c for c in _status(cluster)["conditions"] if c["type"] == "Tuned")
        assert tuned_condition["reason"] == "ConfigHolds"
        # the estimate is status's 120 s, with whatever the stand-in has added to it since
        found = re.search(r"queue depth 150.0 > 100: pressure -> 16/recompute, the best measured \((\d+) tok/s "
                          r"over (\d+) s\)", tuned_condition["message"])
        assert found is not None, tuned_condition["message"]
        assert int(found[2]) >= 120
        assert engines["smol-a"].posts == [] and "TuningCanary" not in _reasons(cluster)


async def test_outcomes_are_kept_for_the_spec_they_were_measured_under_and_dropped_when_it_changes(
        cluster: Any, pods: Any) -> None:
    """Outcomes in a status written before bases were kept are adopted with the spec's basis; an
    edit of an engine flag they depend on drops them and their pauses, with an Event naming it."""
    spec = {"model": {"source": "embedded"}, "resources": {"gpus": 1}, "replicas": 1,
            "engine": {"swapSpace": 1}, "autotune": FAST_TUNING}
    outcomes = [{"blockSize": 16, "preemptionMode": "recompute", "maxNumSeqs": 256, "maxNumBatchedTokens": 2048,
                 "tokensPerSecond": 1000.0, "spread": 10.0, "seconds": 120.0, "windows": 12}]
    pauses = [{"from": {"blockSize": 16, "preemptionMode": "recompute"},
               "to": {"blockSize": 8, "preemptionMode": "swap"}, "pauseMs": 9.0, "switches": 2}]
    await cluster.request("POST", _lifecycle.IS_PATH, {
        "apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "smol", "namespace": NS}, "spec": spec,
        "status": {"tuning": {"outcomes": outcomes, "switchPauses": pauses}}}, "application/json")
    async with operator():
        await pods(["smol-a"])  # at rest: nothing saturated is added, no decision is made
        await eventually(lambda: "outcomesBasis" in _status(cluster).get("tuning", {}), what="the basis in status")
        tuning = _status(cluster)["tuning"]
        assert tuning["outcomes"] == outcomes and tuning["switchPauses"] == pauses
        basis = tuning["outcomesBasis"]
        assert basis["engine"] == "swapSpace=1.0" and basis["model"].startswith("embedded ")
        assert "TuningOutcomesReset" not in _reasons(cluster)

        await cluster.patch_isvc("smol", {"spec": {"engine": {"maxModelLen": 1024}}})
        await eventually(lambda: not {"outcomes", "switchPauses"} & _status(cluster)["tuning"].keys(),
                         what="the outcomes and pauses gone from status")
        assert _status(cluster)["tuning"]["outcomesBasis"] == {**basis, "engine": "maxModelLen=1024, swapSpace=1.0"}
        reset = [m for _, reason, m in cluster.events("smol") if reason == "TuningOutcomesReset"]
        assert len(reset) == 1 and "engine: swapSpace=1.0 -> maxModelLen=1024, swapSpace=1.0" in reset[0], reset


async def test_nothing_is_measured_while_pods_of_two_templates_serve(cluster: Any, pods: Any) -> None:
    """Saturated pods of two pod templates (a rollout under way) add no outcome; once one
    template is left, the same load does."""
    spec = {"model": {"source": "embedded"}, "resources": {"gpus": 1}, "replicas": 2,
            "engine": {"swapSpace": 1},  # pressure to the config in force: measured, never switched
            "autotune": {**FAST_TUNING, "pressure": {"blockSize": 16, "preemptionMode": "recompute"}}}
    async with operator():
        await cluster.create_isvc("smol", spec)
        engines = await pods(["smol-a", "smol-b"])
        for name, template in (("smol-a", "old"), ("smol-b", "new")):
            await cluster.request("PATCH", f"/api/v1/namespaces/{NS}/pods/{name}",
                                  {"metadata": {"labels": {"pod-template-hash": template}}})
        for engine in engines.values():
            engine.waiting = 150
        await eventually(lambda: "queue depth 150.0" in next(
            (c["message"] for c in _status(cluster).get("conditions", []) if c["type"] == "Tuned"), ""),
            timeout=20, what="the tuner deciding on the saturated pods")
        await asyncio.sleep(4)  # several passes of the 1 s interval, every one saturated
        assert _outcome(_status(cluster), 16, "recompute") is None
        await cluster.request("PATCH", f"/api/v1/namespaces/{NS}/pods/smol-a",
                              {"metadata": {"labels": {"pod-template-hash": "new"}}})
        await eventually(lambda: (_outcome(_status(cluster), 16, "recompute") or {}).get("windows", 0) >= 1,
                         what="16/recompute measured once one template is left")
        assert engines["smol-a"].posts == [] and engines["smol-b"].posts == []


async def test_a_pod_that_refuses_the_admin_call_leaves_the_service_on_its_config(cluster: Any, pods: Any) -> None:
    spec = {"model": {"source": "embedded"}, "resources": {"gpus": 1}, "replicas": 1,
            "engine": {"swapSpace": 1}, "autotune": FAST_TUNING}
    async with operator():
        await cluster.create_isvc("smol", spec)
        engines = await pods(["smol-a"])
        engines["smol-a"].refuse = "block_size: the engine refuses to change it now"
        engines["smol-a"].waiting = 150
        await eventually(lambda: cluster.condition("smol", "Tuned") == ("False", "AdminCallFailed"), timeout=30,
                         what="Tuned=False AdminCallFailed")
        tuned = next(c for c in _status(cluster)["conditions"] if c["type"] == "Tuned")
        assert "the engine refuses to change it now" in tuned["message"]
        assert "stays on block_size 16, recompute" in tuned["message"]
        assert engines["smol-a"].settings == (16, "recompute")
        assert "config" not in _status(cluster).get("tuning", {})
        await eventually(lambda: "AdminCallFailed" in _reasons(cluster), what="the AdminCallFailed Event")


def _builtin_on_kv_cache(target: float) -> dict[str, Any]:
    """Two replicas that builtin scales on kvCacheUsage, deciding every second on 2 s windows."""
    return {"model": {"source": "embedded"}, "resources": {"gpus": 1}, "replicas": 2,
            "autoscaling": {"enabled": True, "mode": "builtin", "metric": "kvCacheUsage", "target": target,
                            "maxReplicas": 8, "interval": "1s", "window": "2s"}}


async def test_builtin_autoscaling_writes_replicas_through_the_scale_subresource(cluster: Any, pods: Any) -> None:
    async with operator():
        await cluster.create_isvc("smol", _builtin_on_kv_cache(0.5))
        engines = await pods(["smol-a", "smol-b"])
        engines["smol-a"].kv, engines["smol-b"].kv = 0.9, 0.9  # 1.8 times the target on 2 replicas
        await eventually(lambda: cluster.get("inferenceservices", "smol")["spec"]["replicas"] == 4, timeout=20,
                         what="spec.replicas scaled to 4")
        assert ("PATCH", "inferenceservices", "smol", "scale") in cluster.emulator.writes("inferenceservices")
        await eventually(lambda: cluster.get("deployments", "smol")["spec"]["replicas"] == 4,
                         what="the Deployment following spec.replicas")
        await eventually(lambda: _status(cluster).get("scaling", {}).get("desiredReplicas") == 4,
                         what="status.scaling")
        (decision,) = [d for d in _status(cluster)["decisions"] if d["kind"] == "scale"][:1]
        assert (decision["from"], decision["to"]) == ("2", "4")
        assert decision["metrics"]["kvCacheUsage"] == pytest.approx(0.9)
        await eventually(lambda: "Scaled" in _reasons(cluster), what="the Scaled Event")
        for name in engines:  # deletion costs follow the load: 8 running per pod, in hundredths
            pod = cluster.get("pods", name)
            assert pod["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] == "800"


async def test_a_kv_cache_target_the_queueing_pods_never_reach_is_said_not_silently_held(
        cluster: Any, pods: Any) -> None:
    async with operator():
        await cluster.create_isvc("smol", _builtin_on_kv_cache(0.85))
        engines = await pods(["smol-a", "smol-b"])
        for engine in engines.values():  # a large cache: saturated, requests queue at 7% usage
            engine.kv, engine.waiting = 0.07, 20
        await eventually(lambda: cluster.condition("smol", "ScalingActive") == ("True", "TargetUnreachable"),
                         timeout=20, what="ScalingActive TargetUnreachable")
        active = next(c for c in _status(cluster)["conditions"] if c["type"] == "ScalingActive")
        assert active["message"].startswith("kvCacheUsage target 0.85 is out of the pods' reach: 0.07 while "
                                            "20.0 requests wait per pod")
        await eventually(lambda: "ScalingTargetUnreachable" in _reasons(cluster), what="the Warning Event")
        assert cluster.get("inferenceservices", "smol")["spec"]["replicas"] == 2  # the HPA's rule scales nothing
        for engine in engines.values():
            engine.waiting = 0
        # the HPA's reasons again once nothing queues (0.07 of 0.85 asks for 1: held by the scale-down window)
        await eventually(lambda: cluster.condition("smol", "ScalingActive") == ("True", "ScaleDownStabilized"),
                         timeout=20, what="the condition back once nothing queues")
        assert _reasons(cluster).count("ScalingTargetUnreachable") == 1  # once as it began, not every pass


async def test_an_hpa_on_a_target_the_pods_never_reach_gets_the_warning_too(cluster: Any, pods: Any) -> None:
    spec = {"model": {"source": "embedded"}, "resources": {"gpus": 1}, "replicas": 2,
            "autoscaling": {"enabled": True, "mode": "hpa", "metric": "kvCacheUsage", "target": 0.85, "maxReplicas": 8}}
    async with operator():
        await cluster.create_isvc("smol", spec)
        engines = await pods(["smol-a", "smol-b"])
        for engine in engines.values():
            engine.kv, engine.waiting = 0.07, 20
        # the pilot passes every 15 s in mode hpa (deletion costs); a window needs two scrapes
        await eventually(lambda: "ScalingTargetUnreachable" in _reasons(cluster), timeout=60,
                         what="the Warning Event in mode hpa")
        # the condition stays the reconcile's, about the HPA (this cluster serves no custom metrics API)
        assert cluster.condition("smol", "ScalingActive") == ("False", "CustomMetricsUnavailable")


async def test_keda_without_its_crds_and_monitoring_without_prometheus_operator_are_conditions(
        cluster: Any) -> None:
    spec = {"model": {"source": "embedded"}, "resources": {"gpus": 1},
            "autoscaling": {"enabled": True, "mode": "keda", "prometheusAddress": "http://prometheus:9090"}}
    from kvpilot.operator.monitoring import EngineMonitoring

    async with operator(monitoring=EngineMonitoring(enabled=True)):
        await cluster.create_isvc("smol", spec)
        await eventually(lambda: cluster.condition("smol", "ScalingActive") == ("False", "KedaNotInstalled"),
                         what="ScalingActive=False KedaNotInstalled")
        await eventually(lambda: cluster.condition("smol", "Monitored") == ("False", "PodMonitorApiMissing"),
                         what="Monitored=False PodMonitorApiMissing")
        assert cluster.condition("smol", "Ready") is not None  # the reconcile went on
        assert not [c for c in cluster.emulator.calls if c[1] in ("scaledobjects", "podmonitors")]


@pytest.mark.slow
async def test_a_real_kvpilot_serve_is_tuned_live(cluster: Any, tmp_path: Path) -> None:
    """The whole chain with the real engine: its `/metrics`, its `/admin/config` and its own
    answer afterwards. An idle service off its calm config is moved to it (calm here: block size
    32), through a canary judged on real requests."""
    import asyncio
    import os
    import subprocess

    from server_harness import free_port

    spec = {"model": {"source": "embedded"}, "resources": {"gpus": 0}, "replicas": 1,
            "engine": {"swapSpace": 0, "maxModelLen": 256, "maxNumSeqs": 4},
            "autotune": {**FAST_TUNING, "allowedPreemptionModes": ["recompute"], "calm": {"blockSize": 32},
                         "canary": {"window": "8s", "timeout": "60s", "minRequests": 1, "tolerance": 0.9}}}
    async with operator():
        await cluster.create_isvc("smol", spec)
        secret = await eventually(functools.partial(cluster.get, "secrets", "smol-admin"), what="the admin Secret")
        token = base64.b64decode(secret["data"]["token"]).decode()
        port = free_port()
        log = (tmp_path / "serve.log").open("w")
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "kvpilot"), "serve", "--host", "127.0.0.1", "--port", str(port),
             "--max-model-len", "256", "--max-num-seqs", "4", "--swap-space", "0", "--block-size", "16",
             "--served-model-name", "smol", "--disable-log-stats"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONSAFEPATH": "1", "KVPILOT_ADMIN_TOKEN": token})
        base = f"http://127.0.0.1:{port}"
        stop = asyncio.Event()

        async def traffic() -> None:
            while not stop.is_set():
                try:
                    async with cluster.session.post(f"{base}/v1/completions", json={
                            "model": "smol", "prompt": "The capital of France is", "max_tokens": 4}) as response:
                        await response.read()
                        assert response.status == 200, await response.text()
                except aiohttp.ClientError:
                    await asyncio.sleep(0.2)

        async def ready() -> bool:
            try:
                async with cluster.session.get(f"{base}/ready") as response:
                    return response.status == 200
            except aiohttp.ClientError:
                return False

        try:
            for _ in range(900):
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
                if await ready():
                    break
                await asyncio.sleep(0.2)
            load = asyncio.create_task(traffic())
            await cluster.request("POST", f"/api/v1/namespaces/{NS}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "smol-a", "namespace": NS, "labels": SELECTOR},
                "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": port}]}]},
                "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}},
                "application/json")
            try:
                await eventually(lambda: _status(cluster).get("tuning", {}).get("config", {}).get("blockSize") == 32,
                                 timeout=150, what="the service tuned to block size 32")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; status: {_status(cluster)}; events: {cluster.events('smol')}") from None
            stop.set()
            await load
            async with cluster.session.get(f"{base}/admin/config",
                                           headers={"Authorization": f"Bearer {token}"}) as response:
                engine = await response.json()
            assert engine["block_size"] == 32 and engine["preemption_mode"] == "recompute"
            reasons = _reasons(cluster)
            assert "TuningCanary" in reasons and "TuningPromoted" in reasons
            assert _status(cluster)["tuning"]["pods"] == [{
                "pod": "smol-a", "blockSize": 32, "preemptionMode": "recompute", "maxNumSeqs": 4,
                "maxNumBatchedTokens": engine["max_num_batched_tokens"]}]
        finally:
            stop.set()
            if "load" in locals():
                load.cancel()
            proc.terminate()
            await asyncio.to_thread(proc.wait, 60)
            log.close()
