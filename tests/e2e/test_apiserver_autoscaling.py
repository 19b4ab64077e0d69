"""The pilot and the autoscaling children on a real API server, with the chart's RBAC (its
ServiceAccount's token) and the real HorizontalPodAutoscaler controller: mode hpa creates an HPA
on the InferenceService's scale subresource that the HPA controller can scale; mode builtin
writes the replicas through that subresource; mode keda without KEDA, and engine monitoring
without prometheus-operator, are conditions; autotune gets its ConfigMap and waits for metrics
while no pod is Ready (there is no kubelet: pods stay Pending)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from inference_services import condition, create, new_namespace, reconciled
from kube_control_plane import ControlPlane, OperatorProcess, eventually

SPEC = {"model": {"source": "embedded"}, "resources": {"gpus": 0}}


@pytest.fixture(scope="module")
def operator(control_plane: ControlPlane, cluster_wide_kubeconfig: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process = OperatorProcess(cluster_wide_kubeconfig, ["--all-namespaces", "--standalone", "--engine-monitoring"],
                              log).start()
    yield process
    process.stop()


def _condition(plane: ControlPlane, namespace: str, name: str, type_: str) -> tuple[str, str] | None:
    return condition(plane.get("kvis", name, namespace), type_)


def test_mode_hpa_owns_an_hpa_on_the_scale_subresource(control_plane: ControlPlane, operator: OperatorProcess) -> None:
    namespace = new_namespace(control_plane, "scaling-hpa")
    create(control_plane, namespace, "smol", {**SPEC, "autoscaling": {
        "enabled": True, "mode": "hpa", "metric": "waitingPerReplica", "target": 4, "maxReplicas": 3}})
    obj = reconciled(control_plane, namespace, "smol")
    hpa = eventually(lambda: control_plane.get("hpa", "smol", namespace), what="the HPA")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "serving.kvpilot.io/v1alpha1",
                                             "kind": "InferenceService", "name": "smol"}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    eventually(lambda: _condition(control_plane, namespace, "smol", "ScalingActive")
               == ("False", "CustomMetricsUnavailable"), what="ScalingActive=False without prometheus-adapter")

    def able_to_scale() -> bool:  # the HPA controller read the InferenceService through /scale
        status = (control_plane.get("hpa", "smol", namespace) or {}).get("status", {})
        return any(c["type"] == "AbleToScale" and c["status"] == "True" for c in status.get("conditions") or [])
    eventually(able_to_scale, timeout=60, what="the HPA controller able to scale the InferenceService")

    control_plane.kubectl("patch", "kvis", "smol", "-n", namespace, "--type=merge",
                          "-p", json.dumps({"spec": {"autoscaling": {"mode": "builtin"}}}))
    eventually(lambda: control_plane.get("hpa", "smol", namespace) is None, what="the HPA deleted with mode builtin")


def test_mode_builtin_writes_replicas_through_the_scale_subresource(control_plane: ControlPlane,
                                                                     operator: OperatorProcess) -> None:
    namespace = new_namespace(control_plane, "scaling-builtin")
    create(control_plane, namespace, "smol", {**SPEC, "replicas": 1, "autoscaling": {
        "enabled": True, "minReplicas": 2, "maxReplicas": 4, "interval": "1s"}})
    eventually(lambda: (control_plane.get("kvis", "smol", namespace) or {}).get("spec", {}).get("replicas") == 2,
               what="spec.replicas raised to minReplicas")
    eventually(lambda: (control_plane.get("deployment", "smol", namespace) or {}).get("spec", {}).get("replicas") == 2,
               what="the Deployment at 2 replicas")

    def recorded() -> dict[str, object] | None:
        status = (control_plane.get("kvis", "smol", namespace) or {}).get("status", {})
        scale = [d for d in status.get("decisions") or [] if d["kind"] == "scale"]
        return scale[0] if scale else None
    decision = eventually(recorded, what="the scale decision in status.decisions")
    assert (decision["from"], decision["to"]) == ("1", "2")
    assert "below minReplicas 2" in str(decision["reason"])

    # No kubelet here: the test plays one, marking a pod Ready 37 s after its creation. The
    # operator reads the start-up from the pod's conditions into status, which the real API
    # server's structural schema keeps.
    pods = eventually(lambda: json.loads(control_plane.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)
                      ["items"], what="the Deployment's pods")
    created = datetime.fromisoformat(pods[0]["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    ready = (created + timedelta(seconds=37)).strftime("%Y-%m-%dT%H:%M:%SZ")
    control_plane.kubectl("patch", "pod", pods[0]["metadata"]["name"], "-n", namespace, "--subresource=status",
                          "--type=merge", "-p", json.dumps({"status": {"phase": "Running", "conditions": [
                              {"type": "Ready", "status": "True", "lastTransitionTime": ready}]}}))

    def startup() -> dict[str, object] | None:
        return (control_plane.get("kvis", "smol", namespace) or {}).get("status", {}).get("scaling", {}).get("startup")
    assert eventually(startup, what="status.scaling.startup") == {"seconds": 37.0, "recent": [37.0],
                                                                   "lastReadyTime": ready}


def test_missing_keda_and_prometheus_operator_are_conditions(control_plane: ControlPlane,
                                                             operator: OperatorProcess) -> None:
    namespace = new_namespace(control_plane, "scaling-keda")
    create(control_plane, namespace, "smol", {**SPEC, "autoscaling": {
        "enabled": True, "mode": "keda", "prometheusAddress": "http://prometheus.monitoring.svc:9090"}})
    reconciled(control_plane, namespace, "smol")
    eventually(lambda: _condition(control_plane, namespace, "smol", "ScalingActive") == ("False", "KedaNotInstalled"),
               what="ScalingActive=False KedaNotInstalled")
    assert _condition(control_plane, namespace, "smol", "Monitored") == ("False", "PodMonitorApiMissing")
    assert _condition(control_plane, namespace, "smol", "Degraded") == ("False", "AsExpected")


def test_autotune_gets_its_config_map_and_waits_for_ready_pods(control_plane: ControlPlane,
                                                               operator: OperatorProcess) -> None:
    namespace = new_namespace(control_plane, "tuning")
    create(control_plane, namespace, "smol", {**SPEC, "engine": {"swapSpace": 1},
                                              "autotune": {"enabled": True, "interval": "1s"}})
    reconciled(control_plane, namespace, "smol")
    config_map = eventually(lambda: control_plane.get("configmap", "smol-tuned", namespace), what="the ConfigMap")
    assert json.loads(config_map["data"]["tuned.json"]) == {}
    pod_spec = control_plane.get("deployment", "smol", namespace)["spec"]["template"]["spec"]  # type: ignore[index]
    assert {"name": "tuned", "configMap": {"name": "smol-tuned", "optional": True, "defaultMode": 420}} \
        in pod_spec["volumes"]
    eventually(lambda: _condition(control_plane, namespace, "smol", "Tuned") == ("Unknown", "AwaitingMetrics"),
               what="Tuned=Unknown AwaitingMetrics while no pod is Ready")


def test_the_tuners_memory_in_status_survives_the_schema_and_an_operator_restart(control_plane: ControlPlane,
                                                                                  operator: OperatorProcess) -> None:
    """status.tuning as the operator writes it (the tuned config, the measured outcomes, the switch
    pauses) is kept by the real API server's structural schema, which prunes unknown fields, and a
    restarted operator writes it back as it found it."""
    namespace = new_namespace(control_plane, "tuning-memory")
    create(control_plane, namespace, "smol", {**SPEC, "engine": {"swapSpace": 1},
                                              "autotune": {"enabled": True, "interval": "1s"}})
    reconciled(control_plane, namespace, "smol")
    memory = {
        "config": {"blockSize": 8, "preemptionMode": "swap", "maxNumSeqs": 256, "maxNumBatchedTokens": 2048,
                   "schedulerPolicy": "fcfs"},
        "lastChangeTime": "2026-01-01T00:00:00Z",
        "outcomes": [{"blockSize": 8, "preemptionMode": "swap", "maxNumSeqs": 256, "maxNumBatchedTokens": 2048,
                      "tokensPerSecond": 812.5, "spread": 40.25, "seconds": 96.5, "windows": 19},
                     {"blockSize": 16, "preemptionMode": "recompute", "maxNumSeqs": 256,
                      "maxNumBatchedTokens": 2048, "tokensPerSecond": 640.0, "spread": 0.0, "seconds": 20.0,
                      "windows": 4}],
        "switchPauses": [{"from": {"blockSize": 16, "preemptionMode": "recompute"},
                          "to": {"blockSize": 8, "preemptionMode": "swap"}, "pauseMs": 31.25, "switches": 2}]}
    control_plane.kubectl("patch", "kvis", "smol", "-n", namespace, "--subresource=status", "--type=merge",
                          "-p", json.dumps({"status": {"tuning": memory}}))

    def tuning() -> dict[str, object]:
        return (control_plane.get("kvis", "smol", namespace) or {}).get("status", {}).get("tuning", {})
    # a memory written without a basis takes the spec's (kept by the schema) and keeps its figures
    basis = eventually(lambda: tuning().get("outcomesBasis"), what="status.tuning.outcomesBasis")
    assert basis["engine"] == "swapSpace=1.0" and set(basis) == {"model", "image", "gpus", "placement", "engine"}
    kept = {k: v for k, v in tuning().items() if k in memory}
    assert kept == memory
    operator.stop()
    operator.start()
    eventually(lambda: operator.reconciles() > 0, what="the restarted operator reconciling")
    eventually(lambda: _condition(control_plane, namespace, "smol", "Tuned") == ("Unknown", "AwaitingMetrics"),
               what="Tuned=Unknown AwaitingMetrics from the restarted operator")
    assert {k: v for k, v in tuning().items() if k in memory} == memory and tuning()["outcomesBasis"] == basis


def test_the_chart_rbac_sufficed_for_the_pilot(operator: OperatorProcess) -> None:
    """Run last in this module: no request above was refused (pods, the scale subresource,
    HPAs, ConfigMaps, Events, discovery). A status write may conflict only where the pilot wrote
    spec.replicas through /scale in between (it runs again on fresh data)."""
    assert operator.log_lines("Forbidden") == []
    conflicts = [line for line in operator.log_lines("Conflict") if "inferenceservices" in line]
    assert all("scaling-builtin/smol" in line for line in conflicts), conflicts
