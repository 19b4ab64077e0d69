"""`kvpilot operator` on a real API server, with exactly the RBAC the chart renders (its
ServiceAccount's token) and OwnerReferencesPermissionEnforcement on: examples reconcile, scale and
spec edits reach the Deployment, the engine in force moves only when every pod runs it, hand edits
are repaired, a persistent API error is a condition and one Warning, a restart changes no
resourceVersion, and deletion is the garbage collector's, with the operator running or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from inference_services import (
    CHILDREN,
    children,
    condition,
    create,
    events,
    new_namespace,
    reconciled,
    rolled_out,
)
from kube_control_plane import ControlPlane, OperatorProcess, eventually

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def operator(control_plane: ControlPlane, cluster_wide_kubeconfig: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process = OperatorProcess(cluster_wide_kubeconfig, ["--all-namespaces", "--standalone"], log).start()
    yield process
    process.stop()


def test_every_example_applies_and_reconciles(control_plane: ControlPlane, operator: OperatorProcess) -> None:
    namespace = new_namespace(control_plane, "examples")
    control_plane.kubectl("apply", "-n", namespace, *(f"--filename={p}" for p in EXAMPLES))
    for name in (yaml.safe_load(p.read_text())["metadata"]["name"] for p in EXAMPLES):
        obj = reconciled(control_plane, namespace, name)
        for child in children(control_plane, namespace, name).values():  # type: ignore[union-attr]
            (ref,) = child["metadata"]["ownerReferences"]
            assert (ref["uid"], ref["controller"], ref["blockOwnerDeletion"]) == (obj["metadata"]["uid"], True, True)
        assert condition(obj, "Ready") == ("False", "ReplicasNotReady")  # no kubelet: pods stay Pending
        assert obj["status"]["url"] == f"http://{name}.{namespace}.svc:8000"
        assert "finalizers" not in obj["metadata"]
        posted = events(control_plane, namespace, name)
        assert {(e["source"]["component"], e["reportingComponent"]) for e in posted} == {("kvpilot", "kvpilot")}
        autotune = yaml.safe_load(next(p for p in EXAMPLES if yaml.safe_load(p.read_text())["metadata"]["name"] == name)
                                  .read_text())["spec"].get("autotune", {})
        tuned_config_map = autotune.get("enabled") and autotune.get("apply", "live") == "live"
        # no drift found in what the API server defaulted
        assert sorted(e["reason"] for e in posted) == ["Created"] * (4 + bool(tuned_config_map))


def test_scale_and_spec_edits_reach_the_deployment(control_plane: ControlPlane, operator: OperatorProcess) -> None:
    namespace = new_namespace(control_plane, "edits")
    create(control_plane, namespace, "smol")
    reconciled(control_plane, namespace, "smol")
    eventually(lambda: rolled_out(control_plane, namespace, "smol"), what="the first rollout")
    obj = eventually(lambda: (o := control_plane.get("kvis", "smol", namespace)) and
                     condition(o, "Ready") == ("True", "AllReplicasReady") and o, what="Ready")
    assert obj["status"]["engine"]["blockSize"] == 16 and "engineRollingOut" not in obj["status"]

    template = control_plane.get("deployment", "smol", namespace)["spec"]["template"]  # type: ignore[index]
    control_plane.kubectl("scale", "kvis", "smol", "-n", namespace, "--replicas=2")
    eventually(lambda: control_plane.get("deployment", "smol", namespace)["spec"]["replicas"] == 2,  # type: ignore[index]
               what="2 replicas")
    assert control_plane.get("deployment", "smol", namespace)["spec"]["template"] == template  # type: ignore[index]
    eventually(lambda: rolled_out(control_plane, namespace, "smol"), what="the scale-up")

    control_plane.kubectl("patch", "kvis", "smol", "-n", namespace, "--type=merge",
                          "-p", '{"spec": {"engine": {"blockSize": 32}}}')

    def carries_32() -> bool:
        args = control_plane.get("deployment", "smol", namespace)["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[index]
        return bool(args[args.index("--block-size") + 1] == "32")
    eventually(carries_32, what="the Deployment to carry --block-size 32")
    status = eventually(lambda: (o := control_plane.get("kvis", "smol", namespace)) and
                        "engineRollingOut" in o["status"] and o["status"], what="engineRollingOut")
    assert (status["engine"]["blockSize"], status["engineRollingOut"]["blockSize"]) == (16, 32)
    columns = control_plane.kubectl("get", "kvis", "smol", "-n", namespace, "--no-headers").stdout.split()
    assert columns[4] == "16"  # BLOCK: the old pods still run 16

    eventually(lambda: rolled_out(control_plane, namespace, "smol"), what="the rollout of block size 32")
    status = eventually(lambda: (o := control_plane.get("kvis", "smol", namespace)) and
                        o["status"]["engine"]["blockSize"] == 32 and o["status"], what="block size 32 in force")
    assert "engineRollingOut" not in status
    revision = control_plane.get("deployment", "smol", namespace)["metadata"]["annotations"]  # type: ignore[index]
    assert revision["deployment.kubernetes.io/revision"] == "2"  # one rollout for the one edit


def test_hand_edits_of_children_are_repaired(control_plane: ControlPlane, operator: OperatorProcess) -> None:
    namespace = new_namespace(control_plane, "drift")
    create(control_plane, namespace, "smol")
    reconciled(control_plane, namespace, "smol")
    control_plane.kubectl("set", "image", "deployment/smol", "server=other:1", "-n", namespace)
    eventually(lambda: control_plane.get("deployment", "smol", namespace)["spec"]["template"]["spec"]  # type: ignore[index]
               ["containers"][0]["image"] == "kvpilot:test", timeout=10, what="the image rolled back")
    for kind, pattern in CHILDREN:
        control_plane.kubectl("delete", kind, pattern.format("smol"), "-n", namespace)
    eventually(lambda: children(control_plane, namespace, "smol"), timeout=10, what="every child back")


def test_a_persistent_api_error_is_a_condition_and_one_warning(control_plane: ControlPlane,
                                                               operator: OperatorProcess) -> None:
    """A quota that allows no Service: every create is a 403 until it goes."""
    namespace = new_namespace(control_plane, "quota")
    control_plane.kubectl("create", "quota", "no-services", "--hard=services=0", "-n", namespace)
    eventually(lambda: control_plane.get("quota", "no-services", namespace).get("status", {}).get("hard"),  # type: ignore[union-attr]
               what="the quota to be counted")
    create(control_plane, namespace, "smol")
    obj = eventually(lambda: (o := control_plane.get("kvis", "smol", namespace)) and
                     condition(o, "Degraded") == ("True", "ApiError") and o, what="Degraded=True ApiError")
    degraded = next(c for c in obj["status"]["conditions"] if c["type"] == "Degraded")
    assert "403" in degraded["message"] and "exceeded quota" in degraded["message"]
    warnings = [e for e in events(control_plane, namespace, "smol") if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == ["ReconcileFailed"]
    control_plane.kubectl("delete", "quota", "no-services", "-n", namespace)
    eventually(lambda: condition(control_plane.get("kvis", "smol", namespace), "Degraded") == ("False", "AsExpected"),
               timeout=90, what="Degraded=False once the quota is gone")  # the backoff grows to 60 s
    assert children(control_plane, namespace, "smol") is not None
    assert len([e for e in events(control_plane, namespace, "smol") if e["type"] == "Warning"]) == 1


def test_a_restart_changes_no_resource_version(control_plane: ControlPlane, operator: OperatorProcess) -> None:
    namespace = new_namespace(control_plane, "restart")
    create(control_plane, namespace, "smol")
    reconciled(control_plane, namespace, "smol")
    eventually(lambda: rolled_out(control_plane, namespace, "smol"), what="the rollout")
    eventually(lambda: condition(control_plane.get("kvis", "smol", namespace), "Ready") == ("True", "AllReplicasReady"),
               what="Ready")

    def versions() -> dict[str, str]:
        objs = {"kvis": control_plane.get("kvis", "smol", namespace), **children(control_plane, namespace, "smol")}  # type: ignore[dict-item]
        return {kind: obj["metadata"]["resourceVersion"] for kind, obj in objs.items()}
    before = versions()
    operator.stop()
    operator.start()
    eventually(lambda: operator.reconciles() >= 1, what="the restarted operator to reconcile")
    eventually(lambda: len(json.loads(control_plane.kubectl("get", "kvis", "-A", "-o", "json").stdout)["items"])
               <= operator.reconciles(), what="every InferenceService looked at again")
    assert versions() == before


def test_deletion_is_garbage_collection_also_with_the_operator_stopped(control_plane: ControlPlane,
                                                                       operator: OperatorProcess) -> None:
    namespaces = [new_namespace(control_plane, ns) for ns in ("delete-running", "delete-stopped", "delete-namespace")]
    for ns in namespaces:
        create(control_plane, ns, "smol")
        reconciled(control_plane, ns, "smol")

    def collected(namespace: str) -> bool:
        return all(control_plane.get(kind, pattern.format("smol"), namespace) is None for kind, pattern in CHILDREN)

    control_plane.kubectl("delete", "kvis", "smol", "-n", namespaces[0], "--timeout=30s")
    eventually(lambda: collected(namespaces[0]), what="every child collected")
    operator.stop()
    try:  # nothing waits for the operator: no finalizer
        control_plane.kubectl("delete", "kvis", "smol", "-n", namespaces[1], "--timeout=30s")
        eventually(lambda: collected(namespaces[1]), what="every child collected, the operator stopped")
        control_plane.kubectl("delete", "namespace", namespaces[2], "--timeout=60s")
        assert control_plane.get("namespace", namespaces[2]) is None
    finally:
        operator.start()


def test_the_operator_met_no_403_and_no_409(operator: OperatorProcess) -> None:
    """Run last in this module: the chart's RBAC sufficed for everything above (the quota's 403
    is the one refusal that was wanted), and with one writer per InferenceService its status
    writes never conflicted. (A PUT of a Deployment whose status its controller updated since
    the GET may conflict: it runs again on fresh data, as any controller's would.)"""
    assert [line for line in operator.log_lines("Forbidden") if "exceeded quota" not in line] == []
    assert [line for line in operator.log_lines("Conflict") if "inferenceservices" in line] == []


def test_an_engine_that_cannot_start_is_degraded_with_its_own_message(
        control_plane: ControlPlane, operator: OperatorProcess, tmp_path: Path) -> None:
    """spec.model.quantization and spec.engine.kvCacheDtype reach the pod; when the checkpoint
    contradicts the quantization, `kvpilot serve`
    refuses to start with one line naming both, and that line (the container's termination message,
    which the kubelet takes from the log tail) becomes the Degraded condition."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import save_file

    from kvpilot.runtime.model_source import load_preset

    folder = tmp_path / "awq-model"  # a checkpoint whose config says AWQ (the engine stops before its weights)
    folder.mkdir()
    config = {**load_preset("tiny-llama"), "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(4)}, str(folder / "model.safetensors"))
    namespace = new_namespace(control_plane, "quant")
    create(control_plane, namespace, "awq", {"model": {"source": f"hostpath://{folder}", "quantization": "fp8"},
                                             "engine": {"kvCacheDtype": "fp8"}, "resources": {"gpus": 0}})
    reconciled(control_plane, namespace, "awq")
    args = control_plane.get("deployment", "awq", namespace)["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[index]
    assert args[args.index("--quantization") + 1] == "fp8" and args[args.index("--kv-cache-dtype") + 1] == "fp8"

    # the pod's command, run here on the folder the pod would mount
    args[args.index("--model") + 1] = str(folder)
    served = subprocess.run([str(Path(sys.executable).parent / "kvpilot"), "serve", *args], capture_output=True,
                            text=True, timeout=300)
    assert served.returncode == 2
    last_line = served.stderr.strip().splitlines()[-1]
    assert "fp8 does not match" in last_line and "(awq, in" in last_line
    (pod,) = json.loads(control_plane.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    crashed = {"status": {"containerStatuses": [{  # as the kubelet reports a crash-looping container
        "name": "server", "ready": False, "restartCount": 1, "image": "kvpilot:test", "imageID": "",
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": served.stderr[-2048:]}},
    }]}}
    control_plane.kubectl("patch", "pod", pod["metadata"]["name"], "-n", namespace, "--subresource=status",
                          "--type=merge", "-p", json.dumps(crashed))
    obj = eventually(lambda: (o := control_plane.get("kvis", "awq", namespace)) and
                     condition(o, "Degraded") == ("True", "EngineFailed") and o, what="Degraded=True EngineFailed")
    message = next(c["message"] for c in obj["status"]["conditions"] if c["type"] == "Degraded")
    assert message == f"pod {pod['metadata']['name']}: {last_line}"
