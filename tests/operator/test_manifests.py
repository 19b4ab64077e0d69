"""The builders: every object valid for Kubernetes (strict, offline), secure, owned, and
hashed so that only real changes roll the pods."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kvpilot.operator.manifests import (
    SPEC_HASH_ANNOTATION,
    Owner,
    build_admin_secret,
    build_deployment,
    build_pdb,
    build_service,
    selector_string,
    service_url,
)
from kvpilot.operator.model_source import resolve_model_source
from kvpilot.operator.spec import InferenceServiceSpec

OWNER = Owner(name="llama", namespace="serving", uid="0b8e7c9e-1111-2222-3333-444455556666")
KUBERNETES_VERSIONS = ("1.30", "1.37")

SPECS: dict[str, dict[str, Any]] = {
    "embedded": {"model": {"source": "embedded"}},
    "pvc-autotune": {"model": {"source": "pvc://models/llama-3-8b"}, "replicas": 2,
                     "autotune": {"enabled": True}, "apiKeySecretRef": {"name": "keys", "key": "k"}},
    "hostpath-tp4": {"model": {"source": "hostpath:///data/llama-2-70b"}, "tensorParallelSize": 4,
                     "resources": {"gpus": 4, "cpu": 32, "memory": "320Gi", "shmSize": "16Gi"},
                     "placement": {"nodeSelector": {"gpu": "h100"},
                                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                    "effect": "NoSchedule"}],
                                   "affinity": {"nodeAffinity": {}}, "priorityClassName": "high",
                                   "runtimeClassName": "nvidia"},
                     "imagePullSecrets": [{"name": "regcred"}], "podLabels": {"team": "ml"},
                     "podAnnotations": {"a": "b"}},
    "cpu": {"model": {"source": "preset://llama-3-8b"}, "resources": {"gpus": 0}, "replicas": 0},
}


def _spec(key: str) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(SPECS[key])


def _objects(key: str) -> list[dict[str, Any]]:
    spec = _spec(key)
    source = resolve_model_source(spec.model.source)
    return [build_deployment(OWNER, spec, source, "kvpilot:test"), build_service(OWNER),
            build_admin_secret(OWNER, "token"), build_pdb(OWNER, spec)]


def _deployment(key: str) -> dict[str, Any]:
    return _objects(key)[0]


def _container(key: str) -> dict[str, Any]:
    container: dict[str, Any] = _deployment(key)["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("key", SPECS)
def test_every_object_is_valid_kubernetes(key: str, version: str) -> None:
    for obj in _objects(key):
        kubernetes_validate.validate(obj, desired_version=version, strict=True)


@pytest.mark.parametrize("key", SPECS)
def test_every_child_is_owned_by_the_inference_service(key: str) -> None:
    for obj in _objects(key):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "InferenceService",
                       "name": "llama", "uid": OWNER.uid, "controller": True, "blockOwnerDeletion": True}
        assert obj["metadata"]["namespace"] == "serving"


def test_gpus_are_requested_and_limited() -> None:
    resources = _container("hostpath-tp4")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 4
    assert resources["requests"]["nvidia.com/gpu"] == 4
    assert "cpu" not in resources["limits"]
    assert "nvidia.com/gpu" not in _container("cpu")["resources"]["limits"]


def test_runs_kvpilot_serve_with_the_engine_flags() -> None:
    container = _container("pvc-autotune")
    assert container["command"] == ["kvpilot", "serve"]
    assert "--block-size" in container["args"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_probes_use_health_and_ready_and_startup_covers_model_loading() -> None:
    container = _container("embedded")
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800


def test_drain_has_pre_stop_and_grace_period() -> None:
    deployment = _deployment("embedded")
    assert _container("embedded")["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120


def test_runs_non_root_with_read_only_root_and_no_capabilities() -> None:
    pod = _deployment("embedded")["spec"]["template"]["spec"]
    security = _container("embedded")["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    assert security == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                        "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    mounts = {m["mountPath"] for m in _container("embedded")["volumeMounts"]}
    assert {"/tmp", "/var/cache/kvpilot", "/dev/shm"} <= mounts


def test_model_volume_is_mounted_read_only() -> None:
    pod = _deployment("pvc-autotune")["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in _container("pvc-autotune")["volumeMounts"]
    host = _deployment("hostpath-tp4")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "hostPath": {"path": "/data/llama-2-70b"}} in host


def test_engine_caches_are_the_pods_own_unless_the_operator_names_a_node_folder() -> None:
    spec = _spec("embedded")
    source = resolve_model_source(spec.model.source)
    env = {e["name"]: e.get("value") for e in _container("embedded")["env"]}
    # Triton's compiled kernels live in the cache volume, beside the engine's own cache
    assert env["KVPILOT_CACHE"] == "/var/cache/kvpilot" and env["TRITON_CACHE_DIR"] == "/var/cache/kvpilot/triton"
    assert {"name": "cache", "mountPath": "/var/cache/kvpilot"} in _container("embedded")["volumeMounts"]
    own = _deployment("embedded")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "cache", "emptyDir": {}} in own
    shared = build_deployment(OWNER, spec, source, "kvpilot:test", cache_host_path="/var/cache/kvpilot")
    volumes = shared["spec"]["template"]["spec"]["volumes"]
    assert {"name": "cache", "hostPath": {"path": "/var/cache/kvpilot", "type": "DirectoryOrCreate"}} in volumes
    assert [v["name"] for v in volumes].count("cache") == 1
    kubernetes_validate.validate(shared, desired_version=KUBERNETES_VERSIONS[-1], strict=True)


def test_secrets_come_through_the_environment() -> None:
    env = {e["name"]: e for e in _container("pvc-autotune")["env"]}
    assert env["KVPILOT_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "llama-admin", "key": "token"}
    assert env["KVPILOT_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "k"}
    assert "KVPILOT_API_KEY" not in {e["name"] for e in _container("embedded")["env"]}


def test_prometheus_scrape_annotations() -> None:
    annotations = _deployment("hostpath-tp4")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations["a"] == "b"


def test_placement_reaches_the_pod() -> None:
    pod = _deployment("hostpath-tp4")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("high", "nvidia")
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_selector_is_stable_and_matches_pods_and_service() -> None:
    deployment, service = _objects("hostpath-tp4")[:2]
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert service["spec"]["selector"] == selector
    assert selector_string(OWNER) == "app.kubernetes.io/name=kvpilot,serving.kvpilot.io/inferenceservice=llama"
    assert pod_labels["team"] == "ml"


def test_spec_hash_ignores_replicas_but_not_the_engine() -> None:
    base = SPECS["pvc-autotune"]
    scaled = InferenceServiceSpec.model_validate({**base, "replicas": 7})
    retuned = InferenceServiceSpec.model_validate({**base, "engine": {"blockSize": 32}})
    source = resolve_model_source(scaled.model.source)

    def digest(spec: InferenceServiceSpec) -> str:
        return str(build_deployment(OWNER, spec, source, "kvpilot:test")["metadata"]["annotations"][SPEC_HASH_ANNOTATION])

    assert digest(scaled) == digest(_spec("pvc-autotune"))
    assert digest(retuned) != digest(_spec("pvc-autotune"))


def test_builders_are_pure() -> None:
    assert _objects("hostpath-tp4") == _objects("hostpath-tp4")


def test_admin_secret_and_service_and_url() -> None:
    secret = build_admin_secret(OWNER, "s3cret")
    assert secret["metadata"]["name"] == "llama-admin"
    assert secret["stringData"] == {"token": "s3cret"}
    assert build_service(OWNER)["spec"]["ports"][0]["port"] == 8000
    assert service_url(OWNER) == "http://llama.serving.svc:8000"


def test_pdb_allows_one_pod_down() -> None:
    pdb = build_pdb(OWNER, _spec("embedded"))
    assert pdb["spec"]["maxUnavailable"] == 1
