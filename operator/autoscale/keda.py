"""`mode: keda`: the KEDA `ScaledObject` the operator owns, a pure builder, and the check that
KEDA is installed at all.

KEDA turns the ScaledObject into an HPA of its own on the InferenceService's scale subresource,
fed by its Prometheus scaler: one trigger whose PromQL reads the service's engine series
(`engine_series.py`) over `spec.window`, polled every `spec.interval`. A per-pod metric is summed
over the pods with an AverageValue target (the HPA divides by the replicas); P99 TTFT is one
value for the service with a Value target. `behavior` goes to KEDA's HPA unchanged.

A cluster without KEDA's CRDs cannot store a ScaledObject: the operator asks discovery first
(`missing_api`) and reports a condition instead of failing every reconcile on a 404.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..objects import Manifest
from .engine_series import SERIES, service_selector
from .hpa import scale_target_ref
from .scaling_spec import Mode, ScalingSpec, check_prometheus_address

KEDA_GROUP, KEDA_VERSION = "keda.sh", "v1alpha1"
CUSTOM_METRICS_GROUP = "custom.metrics.k8s.io"
CONDITION_TYPE = "ScalingActive"


def build_scaled_object(service: str, spec: ScalingSpec, metadata: Manifest, *,
                        default_prometheus_address: str | None) -> Manifest:
    """`metadata`: as for every child (name, namespace, labels, ownerReferences);
    `default_prometheus_address`: the operator's, used when the spec names none."""
    address = spec.prometheus_address or default_prometheus_address
    if address is None:
        raise ValueError("prometheus_address: mode keda needs a Prometheus to query; set "
                         "spec.autoscaling.prometheusAddress or the operator's default")
    series = SERIES[spec.metric]
    query = series.service_query(service_selector(metadata["namespace"], service), spec.window)
    return {
        "apiVersion": f"{KEDA_GROUP}/{KEDA_VERSION}",
        "kind": "ScaledObject",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": scale_target_ref(service),
            "pollingInterval": max(1, round(spec.interval)),
            "minReplicaCount": spec.min_replicas,
            "maxReplicaCount": spec.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": spec.behavior.to_hpa(spec.tolerance)}},
            "triggers": [{
                "type": "prometheus",
                "name": spec.metric,
                "metricType": "AverageValue" if series.per_pod else "Value",
                "metadata": {"serverAddress": check_prometheus_address(address), "query": query,
                             "threshold": f"{spec.target:g}"},
            }],
        },
    }


@dataclass(frozen=True)
class MissingApi:
    reason: str  # the condition's reason
    message: str


def missing_api(api_groups: Mapping[str, Any], mode: Mode) -> MissingApi | None:
    """What the cluster lacks for `mode`, from its `GET /apis` (an APIGroupList, as JSON or as
    the kubernetes client's `to_dict()`); None when nothing is missing."""
    served = {(g["name"], v["version"]) for g in api_groups.get("groups") or [] for v in g.get("versions") or []}
    if mode == "keda" and (KEDA_GROUP, KEDA_VERSION) not in served:
        return MissingApi("KedaNotInstalled",
                          f"KEDA is not installed: the API server serves no {KEDA_GROUP}/{KEDA_VERSION}, so no "
                          f"ScaledObject can be created; install KEDA or use mode builtin")
    if mode == "hpa" and not any(group == CUSTOM_METRICS_GROUP for group, _ in served):
        return MissingApi("CustomMetricsUnavailable",
                          f"no custom metrics API ({CUSTOM_METRICS_GROUP}): the HPA cannot read the engines' "
                          f"metrics; install prometheus-adapter with the chart's rules "
                          f"(prometheusAdapterRules.enabled) or use mode builtin")
    return None


def scaling_condition(missing: MissingApi | None) -> Manifest:
    """The service's ScalingActive condition (metav1.Condition's type, status, reason, message)."""
    if missing is None:
        return {"type": CONDITION_TYPE, "status": "True", "reason": "AutoscalerAvailable", "message": ""}
    return {"type": CONDITION_TYPE, "status": "False", "reason": missing.reason, "message": missing.message}
