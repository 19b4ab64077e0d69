"""`mode: hpa`: the `autoscaling/v2` HorizontalPodAutoscaler the operator owns, a pure builder.

The HPA scales the InferenceService itself through its scale subresource (`spec.replicas`,
`status.selector`), never the Deployment, so the operator, which copies the InferenceService's
replicas to its Deployment, and the HPA never write the same field. It reads the engines'
metrics from custom.metrics.k8s.io, served by prometheus-adapter with the chart's rules
(`prometheusAdapterRules.enabled`): a per-pod metric as a `Pods` metric with an AverageValue
target, P99 TTFT as an `Object` metric on the InferenceService with a Value target (the adapter
computes it from the pods' histograms merged, as the builtin policy does).
"""

from __future__ import annotations

from ..manifests import GROUP, KIND, VERSION
from ..objects import Manifest
from .engine_series import SERIES
from .scaling_spec import ScalingSpec, quantity


def scale_target_ref(service: str) -> Manifest:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": service}


def build_hpa(service: str, spec: ScalingSpec, metadata: Manifest) -> Manifest:
    """`metadata`: the child's metadata as the reconciler gives every child (name, namespace,
    labels, ownerReferences)."""
    series = SERIES[spec.metric]
    if series.per_pod:
        metric = {"type": "Pods", "pods": {
            "metric": {"name": series.adapter_name},
            "target": {"type": "AverageValue", "averageValue": quantity(spec.target)}}}
    else:
        metric = {"type": "Object", "object": {
            "describedObject": scale_target_ref(service),
            "metric": {"name": series.adapter_name},
            "target": {"type": "Value", "value": quantity(spec.target)}}}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": scale_target_ref(service),
            "minReplicas": spec.min_replicas,
            "maxReplicas": spec.max_replicas,
            "metrics": [metric],
            "behavior": spec.behavior.to_hpa(spec.tolerance),
        },
    }
