"""An operator restart changes nothing the autotuner did, and ends the canary it left in a
recorded verdict: `kvpilot operator` on a real API server with the chart's RBAC, tuning engine
stand-ins (tests/support/engine_pods.py) that Pod objects point at (Ready, IP 127.0.0.1, the
stand-in's port as the serving port; there is no kubelet).

Before the restart: a service tuned live (its ConfigMap carries the tuned config), one tuned by
rollout (its Deployment's flags do), and two caught in a canary (two pods, and one alone). After
it: the Deployments are as they were but for the Deployment controller's status updates (their
generation, metadata, writers and pod templates; `Service.deployment`), the ConfigMap to its
resourceVersion, the
two-pod canary is judged on by the new operator (promoted), and the lone one, whose window
before the change went with the old operator, is rolled back — each with its Event and its
decision in status. Nothing here races the machine's speed: the canaries' pods finish no request
until the operator has restarted, so no canary can be judged before it, however long the steps
before the restart take."""

from __future__ import annotations

import base64
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_pods import EnginePod, ThreadedEngines
from inference_services import create, new_namespace, reconciled
from kube_control_plane import ControlPlane, OperatorProcess, eventually

FAST_TUNING = {"enabled": True, "interval": "1s", "cooldown": "1s", "minDwell": "1s",
               "canary": {"window": "1s", "timeout": "60s", "minRequests": 1}}
# undecidable while its pods finish no request (EnginePod.serving), for longer than any test waits;
# then judged on several scrapes (five requests each), whose timing on a busy machine is noise
HELD_CANARY = {**FAST_TUNING, "canary": {"window": "1s", "timeout": "30m", "minRequests": 20, "tolerance": 0.3}}


@pytest.fixture(scope="module")
def operator(control_plane: ControlPlane, cluster_wide_kubeconfig: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process = OperatorProcess(cluster_wide_kubeconfig, ["--all-namespaces", "--standalone"], log).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def engines() -> Iterator[ThreadedEngines]:
    served = ThreadedEngines()
    yield served
    served.close()


class Service:
    """One InferenceService in a namespace of its own, read through the official client."""

    def __init__(self, plane: ControlPlane, api: Any, namespace: str, spec: dict[str, Any]) -> None:
        import kubernetes

        self.plane, self.namespace, self.name = plane, new_namespace(plane, namespace), "smol"
        self.core, self.apps = kubernetes.client.CoreV1Api(api), kubernetes.client.AppsV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        create(plane, self.namespace, self.name, spec)
        reconciled(plane, self.namespace, self.name)
        self.engines: dict[str, EnginePod] = {}

    def start_pods(self, engines: ThreadedEngines, names: list[str]) -> None:
        """A stand-in per name, and a Ready Pod of the service pointing at it."""
        secret = self.core.read_namespaced_secret(f"{self.name}-admin", self.namespace)
        token = base64.b64decode(secret.data["token"]).decode()
        for name in names:
            engine, port = engines.start(token)
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "kvpilot",
                                                         "serving.kvpilot.io/inferenceservice": self.name}},
                   "spec": {"automountServiceAccountToken": False, "containers": [
                       {"name": "server", "image": "kvpilot:test", "ports": [{"name": "http", "containerPort": port}]}]}}
            self._default_service_account()
            eventually(functools.partial(self._create_pod, pod), what=f"pod {name} created")
            self.core.patch_namespaced_pod_status(name, self.namespace, {"status": {
                "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                "conditions": [{"type": "Ready", "status": "True"}]}})
            self.engines[name] = engine

    def _default_service_account(self) -> None:
        """The namespace's `default` ServiceAccount, which admission wants before any pod: the
        controller-manager makes it a moment after the namespace, or (seen on a loaded CI machine)
        not within half a minute; made here when it is not there yet."""
        import kubernetes

        try:
            self.core.create_namespaced_service_account(self.namespace, {"metadata": {"name": "default"}})
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:  # the controller-manager made it first
                raise

    def _create_pod(self, pod: dict[str, Any]) -> bool:
        import kubernetes

        try:
            self.core.create_namespaced_pod(self.namespace, pod)
        except kubernetes.client.ApiException as exc:
            if "serviceaccount" not in str(exc.body).lower():
                raise
            return False
        return True

    def load(self, waiting: float, serving: bool = True) -> None:
        for engine in self.engines.values():
            engine.waiting, engine.serving = waiting, serving

    def status(self) -> dict[str, Any]:
        obj = self.custom.get_namespaced_custom_object("serving.kvpilot.io", "v1alpha1", self.namespace,
                                                       "inferenceservices", self.name)
        return obj.get("status") or {}  # type: ignore[no-any-return]

    def tuning(self) -> dict[str, Any]:
        return self.status().get("tuning") or {}

    def deployment(self) -> tuple[Any, Any]:
        """What a write to the Deployment other than the Deployment controller's status updates
        changes (those bump its resourceVersion whenever the controller gets to them, which on a
        loaded machine can be long after the object looked settled): its generation (any spec
        change), its labels and annotations, who wrote what when (managedFields, the status
        subresource's left out), and its pod template."""
        deployment = self.apps.read_namespaced_deployment(self.name, self.namespace)
        meta = deployment.metadata
        writes = sorted((f.manager, f.operation, str(f.time)) for f in meta.managed_fields or []
                        if f.subresource != "status")
        return ((meta.generation, meta.labels, meta.annotations, writes),
                self.apps.api_client.sanitize_for_serialization(deployment.spec.template))

    def config_map(self) -> tuple[str, dict[str, str]]:
        config_map = self.core.read_namespaced_config_map(f"{self.name}-tuned", self.namespace)
        return config_map.metadata.resource_version, dict(config_map.data)

    def events(self) -> list[tuple[str, str]]:
        return [(e.reason, e.message) for e in self.core.list_namespaced_event(self.namespace).items
                if e.involved_object.kind == "InferenceService"]

    def args(self) -> list[str]:
        return list(self.deployment()[1]["spec"]["containers"][0]["args"])


def _settled(read: Callable[[], Any]) -> Any:
    """`read()` once two reads a second apart agree (the Deployment controller has done its writes)."""
    def same() -> Any:
        first = read()
        time.sleep(1)
        return first if read() == first else None
    return eventually(same, timeout=30, what="the object to settle")


def test_a_restart_keeps_what_tuning_did_and_ends_the_canary_it_left(
        control_plane: ControlPlane, admin_api: Any, operator: OperatorProcess, engines: ThreadedEngines) -> None:
    live = Service(control_plane, admin_api, "restart-live", {
        "model": {"source": "embedded"}, "resources": {"gpus": 0}, "engine": {"swapSpace": 1},
        "autotune": FAST_TUNING})
    rollout = Service(control_plane, admin_api, "restart-rollout", {
        "model": {"source": "embedded"}, "resources": {"gpus": 0}, "engine": {"swapSpace": 1},
        "autotune": {**FAST_TUNING, "apply": "rollout"}})
    pair = Service(control_plane, admin_api, "restart-canary", {
        "model": {"source": "embedded"}, "resources": {"gpus": 0}, "engine": {"swapSpace": 1},
        "autotune": HELD_CANARY})
    alone = Service(control_plane, admin_api, "restart-alone", {
        "model": {"source": "embedded"}, "resources": {"gpus": 0}, "engine": {"swapSpace": 1},
        "autotune": HELD_CANARY})
    live.start_pods(engines, ["smol-a", "smol-b"])
    rollout.start_pods(engines, ["smol-a"])
    pair.start_pods(engines, ["smol-a", "smol-b"])
    alone.start_pods(engines, ["smol-a"])

    live.load(150)  # above queueDepthHigh: pressure, 8/swap
    rollout.load(150)
    eventually(lambda: live.tuning().get("config", {}).get("blockSize") == 8, timeout=60, what="live tuned to 8")
    eventually(lambda: '"block_size": 8' in live.config_map()[1]["tuned.json"], what="the ConfigMap tuned")
    eventually(lambda: rollout.args()[rollout.args().index("--block-size") + 1] == "8", timeout=60,
               what="the rollout service's flags tuned to 8")
    pair.load(150, serving=False)  # pressure, and no finished request to judge a canary by
    alone.load(150, serving=False)
    eventually(lambda: "canary" in pair.tuning() and "canary" in alone.tuning(), timeout=60,
               what="both canaries under way")
    live_deployment, config_map = _settled(live.deployment), live.config_map()
    rollout_deployment = _settled(rollout.deployment)
    posts = {name: len(e.posts) for name, e in live.engines.items()}
    canary_pod = pair.tuning()["canary"]["pod"]
    assert "canary" in pair.tuning() and "canary" in alone.tuning(), "a canary ended before the restart"
    posts_alone = len(alone.engines["smol-a"].posts)
    operator.stop()
    scrapes = {name: e.scrapes for name, e in live.engines.items()}
    operator.start()
    # requests finish again on the pair: the new operator can judge its canary; the lone pod's stay
    # held, so that a canary the next passes try again there cannot end while the test reads
    pair.load(150)

    def ended(service: Service) -> dict[str, Any] | None:
        decisions = service.status().get("decisions") or []
        return next((d for d in decisions if d["reason"].startswith(("promoted", "rolled back"))), None)
    promoted = eventually(lambda: ended(pair), timeout=60, what="the two-pod canary judged by the new operator")
    assert promoted["reason"].startswith(f"promoted from pod {canary_pod}: both at capacity"), promoted
    assert all(e.settings == (8, "swap") for e in pair.engines.values())
    assert any(reason == "TuningPromoted" for reason, _ in pair.events())
    rolled_back = eventually(lambda: ended(alone), timeout=30, what="the lone canary rolled back")
    assert rolled_back["reason"] == ("rolled back on pod smol-a: the operator restarted during the canary and the "
                                     "window before the change, which a lone canary is judged against, was lost")
    # (the next passes may try the change again: the pressure lasts and the test's cooldown is 1 s)
    assert {"block_size": 16, "preemption_mode": "recompute"} in alone.engines["smol-a"].posts[posts_alone:]
    assert [m for r, m in alone.events() if r == "TuningRolledBack"] == [
        "pod smol-a back to block_size 16, recompute, max_num_seqs 256, max_num_batched_tokens 2048: "
        + rolled_back["reason"].split(": ", 1)[1]]
    # several passes of the new operator's pilot for the live service have run (each scrapes every pod)
    eventually(lambda: all(e.scrapes >= scrapes[name] + 3 for name, e in live.engines.items()), timeout=60,
               what="three passes of the live service's pilot after the restart")

    assert live.deployment() == live_deployment and live.config_map() == config_map
    assert rollout.deployment() == rollout_deployment
    assert {name: len(e.posts) for name, e in live.engines.items()} == posts
    assert live.tuning()["config"]["blockSize"] == 8 and rollout.tuning()["config"]["blockSize"] == 8
