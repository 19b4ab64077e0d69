"""The CRD: names, subresources, columns, defaults that agree with the operator's, and
specs the API server must reject, each with the schema's own message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvpilot.operator.spec import InferenceServiceSpec

Admission = Callable[[dict[str, Any]], tuple[dict[str, Any], list[str]]]
MODEL = {"model": {"source": "embedded"}}


def test_names_scope_and_short_name(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "inferenceservices.serving.kvpilot.io"
    assert (spec["group"], spec["scope"]) == ("serving.kvpilot.io", "Namespaced")
    assert spec["names"]["kind"] == "InferenceService"
    assert spec["names"]["plural"] == "inferenceservices"
    assert spec["names"]["shortNames"] == ["kvis"]
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]


def test_scale_subresource_points_at_replicas_and_selector(crd: dict[str, Any]) -> None:
    sub = crd["spec"]["versions"][0]["subresources"]
    assert sub["status"] == {}
    assert sub["scale"] == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector"}


def test_printer_columns(crd: dict[str, Any]) -> None:
    columns = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns == {
        "Model": ".spec.model.source", "Replicas": ".spec.replicas", "Ready": ".status.readyReplicas",
        "Block": ".status.engine.blockSize", "Preemption": ".status.engine.preemptionMode",
        "KV-Usage": ".status.metrics.kvCacheUsage", "Age": ".metadata.creationTimestamp",
    }


def _walk(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, prop in (node.get("properties") or {}).items():
        found += _walk(prop, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        found += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _walk(node["additionalProperties"], f"{path}{{}}")
    return found


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    untyped = [path for path, node in _walk(schema, "")
               if "type" not in node and not node.get("x-kubernetes-int-or-string")]
    assert not untyped


def test_every_cel_rule_has_a_message(schema: dict[str, Any]) -> None:
    rules = [r for _, node in _walk(schema, "") for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 10
    assert all(r.get("message") for r in rules)


def test_defaults_agree_with_the_operators_model(admission: Admission, make_isvc: Callable[..., Any]) -> None:
    defaulted, errors = admission(make_isvc(MODEL))
    assert not errors
    ours = InferenceServiceSpec.model_validate(MODEL).model_dump(by_alias=True, exclude_none=True, mode="json")
    # Fields without a schema default that the model fills with an empty value are not compared.
    for key in ("imagePullSecrets", "podAnnotations", "podLabels"):
        ours.pop(key)
    ours["placement"] = {k: v for k, v in ours["placement"].items() if v}
    assert defaulted["spec"] == ours


def test_minimal_spec_is_admitted(admission: Admission, make_isvc: Callable[..., Any]) -> None:
    assert admission(make_isvc(MODEL))[1] == []


@pytest.mark.parametrize(("spec", "message"), [
    ({"engine": {"blockSize": 12}}, "12 is not one of [8, 16, 32, 64]"),
    ({"engine": {"preemptionMode": "evict"}}, "'evict' is not one of ['recompute', 'swap']"),
    ({"engine": {"schedulerPolicy": "lifo"}}, "'lifo' is not one of ['fcfs', 'fair', 'priority']"),
    ({"engine": {"gpuMemoryUtilization": 0}}, "less than or equal to the minimum of 0"),
    ({"engine": {"gpuMemoryUtilization": 1.2}}, "1.2 is greater than the maximum of 1"),
    ({"replicas": -1}, "-1 is less than the minimum of 0"),
    ({"tensorParallelSize": 0}, "0 is less than the minimum of 1"),
    ({"autotune": {"apply": "restart"}}, "'restart' is not one of ['live', 'rollout']"),
    ({"autotune": {"allowedBlockSizes": [8, 24]}}, "24 is not one of [8, 16, 32, 64]"),
    ({"autotune": {"interval": "soon"}}, "'soon' does not match"),
    ({"autoscaling": {"mode": "keda"}}, "'keda' is not one of ['builtin', 'hpa']"),
    ({"resources": {"memory": "lots"}}, "'lots' does not match"),
    ({"model": {"source": "not a uri"}}, "'not a uri' does not match"),
    ({"model": {}}, "'source' is a required property"),
])
def test_schema_rejects(admission: Admission, make_isvc: Callable[..., Any], spec: dict[str, Any],
                        message: str) -> None:
    errors = admission(make_isvc({**MODEL, **spec}))[1]
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize(("spec", "message"), [
    ({"tensorParallelSize": 3, "resources": {"gpus": 4}}, "tensorParallelSize must divide resources.gpus"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas must be <= autoscaling.maxReplicas"),
    ({"autoscaling": {"metric": "kvCacheUsage", "target": 2}}, "target for kvCacheUsage is a ratio"),
    ({"engine": {"preemptionMode": "swap", "swapSpace": 0}}, "swap needs engine.swapSpace > 0"),
    ({"engine": {"maxNumSeqs": 512, "maxNumBatchedTokens": 256}}, "maxNumBatchedTokens must be >= engine.maxNumSeqs"),
    ({"engine": {"maxModelLen": 8192, "maxNumBatchedTokens": 4096}}, "without chunked prefill"),
    ({"autotune": {"enabled": True, "allowedBlockSizes": [8]}}, "blockSize must be one of autotune.allowedBlockSizes"),
    ({"autotune": {"enabled": True, "allowedPreemptionModes": ["swap"]}}, "preemptionMode must be one of"),
    ({"autotune": {"enabled": True}, "engine": {"swapSpace": 0}}, "swap only with engine.swapSpace > 0"),
    ({"autotune": {"thresholds": {"kvCacheUsageLow": 0.95}}}, "kvCacheUsageLow must be < kvCacheUsageHigh"),
    ({"drain": {"preStopSeconds": 60, "gracePeriodSeconds": 30}}, "preStopSeconds must be < drain.gracePeriodSeconds"),
    ({"model": {"source": "preset://llama-3-8b", "loadFormat": "safetensors"}}, "preset:// model has no weights"),
])
def test_cel_rules_reject(admission: Admission, make_isvc: Callable[..., Any], spec: dict[str, Any],
                          message: str) -> None:
    errors = admission(make_isvc({**MODEL, **spec}))[1]
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("spec", [
    {"tensorParallelSize": 4, "resources": {"gpus": 4}},
    {"tensorParallelSize": 2, "resources": {"gpus": 0}},
    {"engine": {"maxModelLen": 8192, "maxNumBatchedTokens": 2048, "enableChunkedPrefill": True}},
    {"autotune": {"enabled": True, "allowedBlockSizes": [16, 32]}},
    {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 1, "mode": "hpa"}},
])
def test_cross_field_rules_admit_sound_specs(admission: Admission, make_isvc: Callable[..., Any],
                                             spec: dict[str, Any]) -> None:
    assert admission(make_isvc({**MODEL, **spec}))[1] == []


def test_name_longer_than_children_allow_is_rejected(admission: Admission, make_isvc: Callable[..., Any]) -> None:
    errors = admission(make_isvc(MODEL, name="x" * 51))[1]
    assert any("at most 50 characters" in e for e in errors)
