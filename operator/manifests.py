"""Pure builders: an InferenceService -> the Kubernetes objects that serve it.

No I/O here; the reconciler compares what these return with the cluster. Every child carries
the same labels, a controller ownerReference (garbage collection and `kubectl tree`), and a
`spec-hash` annotation over everything the operator decides except the replica count, so an
unchanged spec costs one GET and no write, and `kubectl scale` does not roll the pods.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from kvpilot.runtime.tunables import TUNABLES

from .engine_args import SERVE_PORT, serve_args
from .model_source import ModelSource
from .objects import Manifest
from .spec import InferenceServiceSpec

GROUP = "serving.kvpilot.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
INSTANCE_LABEL = f"{GROUP}/inferenceservice"
SPEC_HASH_ANNOTATION = f"{GROUP}/spec-hash"
MANAGED_BY = "kvpilot-operator"
ENGINE_CONTAINER = "server"  # the pod's `kvpilot serve` container
CACHE_DIR = "/var/cache/kvpilot"
# Triton's compiled kernels live in the same volume, so a node-wide one (--engine-cache-host-path)
# lets a second pod on the node load what the first compiled
TRITON_CACHE_DIR = f"{CACHE_DIR}/triton"
ADMIN_TOKEN_KEY = "token"
# The live config the autotuner tuned the service to, which a pod (re)started later reads at start.
TUNED_CONFIG_DIR = "/etc/kvpilot/tuned"
TUNED_CONFIG_KEY = "tuned.json"
PROBE_PERIOD_SECONDS = 10



@dataclass(frozen=True)
class Owner:
    """The InferenceService a child belongs to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Any) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid", ""))

    @property
    def admin_secret_name(self) -> str:
        return f"{self.name}-admin"

    @property
    def tuned_config_name(self) -> str:
        return f"{self.name}-tuned"


def tunes_live(spec: InferenceServiceSpec) -> bool:
    return spec.autotune.enabled and spec.autotune.apply == "live"


def selector_labels(owner: Owner) -> dict[str, str]:
    # Immutable in a Deployment: never add to it.
    return {"app.kubernetes.io/name": "kvpilot", INSTANCE_LABEL: owner.name}


def selector_string(owner: Owner) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(owner).items())


def labels(owner: Owner) -> dict[str, str]:
    return {
        **selector_labels(owner),
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def service_url(owner: Owner) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{SERVE_PORT}"


def owner_reference(owner: Owner) -> Manifest:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Owner, name: str) -> Manifest:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner),
        "ownerReferences": [owner_reference(owner)],
    }


def spec_hash(obj: Manifest) -> str:
    """A digest of what the operator decides for `obj`, replicas excluded."""
    essence = {k: v for k, v in obj.items() if k not in ("metadata", "status")}
    if isinstance(essence.get("spec"), dict):
        essence["spec"] = {k: v for k, v in essence["spec"].items() if k != "replicas"}
    essence["labels"] = obj.get("metadata", {}).get("labels", {})
    digest = hashlib.sha256(json.dumps(essence, sort_keys=True).encode()).hexdigest()
    return digest[:16]


def with_spec_hash(obj: Manifest) -> Manifest:
    annotations = obj["metadata"].setdefault("annotations", {})
    annotations[SPEC_HASH_ANNOTATION] = spec_hash(obj)
    return obj


def _env(owner: Owner, spec: InferenceServiceSpec) -> list[Manifest]:
    env: list[Manifest] = [
        {"name": "KVPILOT_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": owner.admin_secret_name, "key": ADMIN_TOKEN_KEY}}},
    ]
    if spec.api_key_secret_ref is not None:
        env.append({"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": spec.api_key_secret_ref.name, "key": spec.api_key_secret_ref.key}}})
    env += [
        {"name": "KVPILOT_CACHE", "value": CACHE_DIR},
        {"name": "TRITON_CACHE_DIR", "value": TRITON_CACHE_DIR},
        {"name": "HOME", "value": "/tmp"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    return env


def _resources(spec: InferenceServiceSpec) -> Manifest:
    res = spec.resources
    requests: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    # No CPU limit: throttling the engine loop costs latency; memory is limited to protect the node.
    limits: dict[str, Any] = {"memory": res.memory}
    if res.gpus:
        requests["nvidia.com/gpu"] = res.gpus
        limits["nvidia.com/gpu"] = res.gpus
    return {"requests": requests, "limits": limits}


def _volumes(spec: InferenceServiceSpec, source: ModelSource,
             cache_host_path: str | None = None) -> tuple[list[Manifest], list[Manifest]]:
    """The pod's volumes and the server's mounts. The engine's caches (compiled kernels, converted
    GGUF files) are the pod's own unless the operator names a node folder for every pod on the node
    to share (`cache_host_path`: it must be writable by uid 1000; the engine falls back to a private
    folder, with a warning, where it is not)."""
    cache: Manifest = ({"hostPath": {"path": cache_host_path, "type": "DirectoryOrCreate"}}
                       if cache_host_path else {"emptyDir": {}})
    volumes: list[Manifest] = [
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "cache", **cache},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}},
    ]
    mounts: list[Manifest] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if source.volume is not None and source.mount_path is not None:
        volumes.append(source.volume)
        mounts.append({"name": source.volume["name"], "mountPath": source.mount_path, "readOnly": True})
    return volumes, mounts


def _tuned_volume(owner: Owner, spec: InferenceServiceSpec) -> tuple[list[Manifest], list[Manifest]]:
    """The tuned-config ConfigMap, optional: a pod that starts before the first tuning runs its flags."""
    if not tunes_live(spec):
        return [], []
    return ([{"name": "tuned", "configMap": {"name": owner.tuned_config_name, "optional": True}}],
            [{"name": "tuned", "mountPath": TUNED_CONFIG_DIR, "readOnly": True}])


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> Manifest:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def build_container(owner: Owner, spec: InferenceServiceSpec, source: ModelSource, image: str) -> Manifest:
    served_name = spec.model.served_model_name or owner.name
    _, mounts = _volumes(spec, source)
    mounts += _tuned_volume(owner, spec)[1]
    args = serve_args(spec, source, served_name)
    if tunes_live(spec):
        args += ["--tuned-config", f"{TUNED_CONFIG_DIR}/{TUNED_CONFIG_KEY}"]
    return {
        "name": ENGINE_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvpilot", "serve"],
        "args": args,
        "ports": [{"name": "http", "containerPort": SERVE_PORT, "protocol": "TCP"}],
        "env": _env(owner, spec),
        "resources": _resources(spec),
        "volumeMounts": mounts,
        # Model loading can take many minutes: the startup probe holds liveness back until then.
        "startupProbe": _probe("/health", PROBE_PERIOD_SECONDS,
                               math.ceil(spec.startup_timeout_seconds / PROBE_PERIOD_SECONDS)),
        "livenessProbe": _probe("/health", PROBE_PERIOD_SECONDS, 3),
        "readinessProbe": _probe("/ready", 5, 2, timeout=3),
        # SIGTERM makes the server drain (503, /ready false); the sleep first lets the endpoints
        # controller take the pod out of the Service so no new request races the drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": spec.drain.pre_stop_seconds}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def build_deployment(owner: Owner, spec: InferenceServiceSpec, source: ModelSource, image: str,
                     cache_host_path: str | None = None) -> Manifest:
    volumes, _ = _volumes(spec, source, cache_host_path)
    volumes += _tuned_volume(owner, spec)[0]
    placement = spec.placement
    pod_spec: Manifest = {
        "containers": [build_container(owner, spec, source, image)],
        "volumes": volumes,
        "automountServiceAccountToken": False,  # the server never calls the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.drain.grace_period_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    if placement.node_selector:
        pod_spec["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in placement.tolerations]
    if placement.affinity:
        pod_spec["affinity"] = placement.affinity
    if placement.priority_class_name:
        pod_spec["priorityClassName"] = placement.priority_class_name
    if placement.runtime_class_name:
        pod_spec["runtimeClassName"] = placement.runtime_class_name
    pod_annotations = {
        **spec.pod_annotations,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(SERVE_PORT),
        "prometheus.io/path": "/metrics",
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, owner.name),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(owner)},
            "revisionHistoryLimit": 5,
            # Past the startup budget, a stuck rollout is reported (Degraded) rather than waited on.
            "progressDeadlineSeconds": spec.startup_timeout_seconds + 600,
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
            "template": {
                "metadata": {"labels": {**spec.pod_labels, **labels(owner)}, "annotations": pod_annotations},
                "spec": pod_spec,
            },
        },
    }
    return with_spec_hash(deployment)


def build_service(owner: Owner) -> Manifest:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, owner.name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner),
            "ports": [{"name": "http", "port": SERVE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return with_spec_hash(service)


def build_admin_secret(owner: Owner, token: str) -> Manifest:
    """The admin token for /admin/config; created once, then never rewritten."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(owner, owner.admin_secret_name),
        "type": "Opaque",
        "stringData": {ADMIN_TOKEN_KEY: token},
    }


def build_tuned_config_map(owner: Owner, tuned: Manifest) -> Manifest:
    """`tuned`: the live tunables in `GET /admin/config`'s names ({} before the first tuning)."""
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, owner.tuned_config_name),
        "data": {TUNED_CONFIG_KEY: json.dumps(tuned, sort_keys=True)},
    }
    return with_spec_hash(config_map)


def child_metadata(owner: Owner, name: str) -> Manifest:
    """Name, namespace, labels and the controller ownerReference, as every child carries them."""
    return _metadata(owner, name)


def build_pdb(owner: Owner, spec: InferenceServiceSpec) -> Manifest:
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, owner.name),
        "spec": {
            "maxUnavailable": spec.pod_disruption_budget.max_unavailable,
            "selector": {"matchLabels": selector_labels(owner)},
            # A pod that never became ready may be evicted: it serves nothing.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    return with_spec_hash(pdb)


def engine_config(owner: Owner, spec: InferenceServiceSpec, source: ModelSource) -> Manifest:
    """The engine configuration the spec's pods run with, as status.engine shows it."""
    engine = spec.engine
    config: Manifest = {
        "model": source.model_arg or "embedded",
        "servedModelName": spec.model.served_model_name or owner.name,
        "gpuMemoryUtilization": engine.gpu_memory_utilization,
        "tensorParallelSize": spec.tensor_parallel_size,
    }
    for tunable in TUNABLES:  # each live tunable the spec sets (an unset one: the runtime's default)
        value = getattr(engine, tunable.name)
        if value is not None:
            config[tunable.camel] = value
    return config
