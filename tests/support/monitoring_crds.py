"""Strict offline validation of prometheus-operator objects (PodMonitor, ServiceMonitor,
PrometheusRule) against the published monitoring.coreos.com/v1 field layout.

The models come from cloudcoil-models-prometheus-operator, generated from prometheus-operator's
CRDs: they check types, enums and patterns. The API server would also *prune* an unknown field
silently (a misspelt `scrapeTimout` just vanishes), so a field the model does not keep is
reported too, as the API server's strict field validation would.
"""

from __future__ import annotations

from typing import Any

import pydantic
from cloudcoil.models.prometheus_operator import v1

MODELS: dict[str, type[pydantic.BaseModel]] = {
    "PodMonitor": v1.PodMonitor,
    "ServiceMonitor": v1.ServiceMonitor,
    "PrometheusRule": v1.PrometheusRule,
}


def _unknown_fields(given: Any, kept: Any, path: str) -> list[str]:
    if isinstance(given, dict) and isinstance(kept, dict):
        problems = [f"{path}.{key}: unknown field" for key in given if key not in kept]
        for key in given.keys() & kept.keys():
            problems += _unknown_fields(given[key], kept[key], f"{path}.{key}")
        return problems
    if isinstance(given, list) and isinstance(kept, list):
        return [p for i, (g, k) in enumerate(zip(given, kept, strict=False))
                for p in _unknown_fields(g, k, f"{path}[{i}]")]
    return []


def monitoring_problems(doc: dict[str, Any]) -> list[str]:
    """[] when `doc` is a valid monitoring.coreos.com/v1 object of a known kind."""
    if doc.get("apiVersion") != "monitoring.coreos.com/v1" or doc.get("kind") not in MODELS:
        return [f"not a monitoring.coreos.com/v1 PodMonitor, ServiceMonitor or PrometheusRule: "
                f"{doc.get('apiVersion')} {doc.get('kind')}"]
    try:
        parsed = MODELS[doc["kind"]].model_validate(doc)
    except pydantic.ValidationError as exc:
        return [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
    return _unknown_fields(doc, parsed.model_dump(by_alias=True, exclude_unset=True, mode="json"), doc["kind"])
