"""An offline stand-in for what the API server does with the InferenceService CRD and its
objects, and the specs it must refuse — shared by the offline CRD tests (tests/operator) and the
same cases against a real API server (tests/e2e).

Two checks, in the API server's order:

* installing the CRD: every `default:` is validated *as written* — the OpenAPI schema and the CEL
  rules of its node and of the nodes below it that the default sets — before any nested default
  fills it in (apiextensions' `ValidateDefaults`). A rule that reads a field which `default: {}`
  lacks fails there with "no such key".
* admitting an object: structural defaulting first (recursing into defaulted values), then the
  OpenAPI schema (jsonschema) and the CEL rules (cel-python).
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.serving.kvpilot.io.yaml"
MODEL = {"model": {"source": "embedded"}}

# (spec fields over MODEL, what the offline schema check says): refused by the OpenAPI schema.
SCHEMA_REJECTS: list[tuple[dict[str, Any], str]] = [
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
    ({"autoscaling": {"mode": "fifo"}}, "'fifo' is not one of ['builtin', 'hpa', 'keda']"),
    ({"autoscaling": {"metric": "numRequestsWaiting"}}, "'numRequestsWaiting' is not one of"),
    ({"autoscaling": {"minReplicas": 0}}, "0 is less than the minimum of 1"),
    ({"autotune": {"canary": {"tolerance": 1}}}, "greater than or equal to the maximum of 1"),
    ({"resources": {"memory": "lots"}}, "'lots' does not match"),
    ({"model": {"source": "not a uri"}}, "'not a uri' does not match"),
    ({"model": {}}, "'source' is a required property"),
]

# (spec fields over MODEL, the rule's message): refused by a CEL rule, with that very message
# from the API server too.
CEL_REJECTS: list[tuple[dict[str, Any], str]] = [
    ({"tensorParallelSize": 3, "resources": {"gpus": 4}}, "tensorParallelSize must divide resources.gpus"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas must be <= autoscaling.maxReplicas"),
    ({"autoscaling": {"metric": "kvCacheUsage", "target": 2}}, "target for kvCacheUsage is a ratio"),
    ({"autoscaling": {"target": 4}}, "target for kvCacheUsage is a ratio"),  # the default metric
    ({"autoscaling": {"mode": "hpa", "window": "30s"}}, "window and interval are the cluster's with mode hpa"),
    ({"autoscaling": {"prometheusAddress": "http://prometheus:9090"}}, "prometheusAddress is read only with mode keda"),
    ({"autoscaling": {"mode": "hpa", "forecast": {"enabled": True}}}, "forecast is read only with mode builtin"),
    ({"autoscaling": {"forecast": {"enabled": False, "horizon": "90s"}}}, "horizon and lookback do nothing"),
    ({"autotune": {"thresholds": {"queueDepthLow": 150}}}, "queueDepthLow must be <= queueDepthHigh"),
    ({"autotune": {"maxNumSeqs": {"min": 64, "max": 8}}}, "min must be <= max"),
    ({"engine": {"preemptionMode": "swap", "swapSpace": 0}}, "swap needs engine.swapSpace > 0"),
    ({"engine": {"maxNumSeqs": 512, "maxNumBatchedTokens": 256}}, "maxNumBatchedTokens must be >= engine.maxNumSeqs"),
    ({"engine": {"maxModelLen": 8192, "maxNumBatchedTokens": 4096, "enableChunkedPrefill": False}},
     "without chunked prefill"),
    ({"autotune": {"enabled": True, "allowedBlockSizes": [8]}}, "blockSize must be one of autotune.allowedBlockSizes"),
    ({"autotune": {"enabled": True, "allowedPreemptionModes": ["swap"]}}, "preemptionMode must be one of"),
    ({"autotune": {"enabled": True}, "engine": {"swapSpace": 0}}, "swap only with engine.swapSpace > 0"),
    ({"autotune": {"thresholds": {"kvCacheUsageLow": 0.95}}}, "kvCacheUsageLow must be <= kvCacheUsageHigh"),
    ({"drain": {"preStopSeconds": 60, "gracePeriodSeconds": 30}}, "preStopSeconds must be < drain.gracePeriodSeconds"),
    ({"drain": {"preStopSeconds": 200}}, "preStopSeconds must be < drain.gracePeriodSeconds"),  # default grace 120
    ({"model": {"source": "preset://llama-3-8b", "loadFormat": "safetensors"}}, "preset:// model has no weights"),
]

# Specs near the rules' edges that both checks admit.
SOUND_SPECS: list[dict[str, Any]] = [
    {"tensorParallelSize": 4, "resources": {"gpus": 4}},
    {"tensorParallelSize": 2, "resources": {"gpus": 0}},
    {"engine": {"maxModelLen": 8192, "maxNumBatchedTokens": 2048}},  # chunked prefill is the default
    {"engine": {"preemptionMode": "swap"}},  # the default swapSpace, 4
    {"autotune": {"enabled": True, "allowedBlockSizes": [16, 32]}},
    {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 1, "mode": "hpa"}},
    {"autoscaling": {"enabled": True, "mode": "keda", "prometheusAddress": "http://prometheus:9090", "window": "2m"}},
    {"autotune": {"enabled": True, "maxNumSeqs": {"min": 8, "max": 8}, "thresholds": {"queueDepthLow": 100}}},
    {"autoscaling": {"metric": "kvCacheUsage", "target": 0.8}},
    {"autoscaling": {"enabled": True, "forecast": {"horizon": "90s", "lookback": "2m"}}},
    {"autoscaling": {"enabled": True, "forecast": {"enabled": False}}},
]


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


def openapi_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    return (crd or load_crd())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def to_json_schema(node: Any) -> Any:
    """OpenAPI v3.0 -> JSON Schema: boolean exclusive bounds become numeric; x-kubernetes-* go."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(exclusive) is True:
            out[exclusive] = out.pop(bound)
        elif out.get(exclusive) is False:
            del out[exclusive]
    out.pop("nullable", None)
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it, recursing into defaulted values."""
    if isinstance(value, dict):
        for name, prop in (schema.get("properties") or {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                value[name] = apply_defaults(prop, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in (schema.get("properties") or {}):
                    value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


@cache
def _cel_program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _rule_holds(rule: str, value: Any) -> bool:
    """False also when the rule cannot be evaluated (a missing key), as the API server says."""
    try:
        result = _cel_program(rule).evaluate({"self": celpy.json_to_cel(value)})
    except celpy.CELEvalError:
        return False
    return not isinstance(result, celpy.CELEvalError) and bool(result)


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """The messages of the rules `value` breaks, in this node and every node below that it sets."""
    errors = [f"{path or '<root>'}: {rule.get('message', rule['rule'])}"
              for rule in schema.get("x-kubernetes-validations", []) if not _rule_holds(rule["rule"], value)]
    if isinstance(value, dict):
        for name, prop in (schema.get("properties") or {}).items():
            if name in value:
                errors += cel_errors(prop, value[name], f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def _schema_errors(schema: dict[str, Any], value: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(to_json_schema(schema))
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(value)]


def default_errors(schema: dict[str, Any], path: str = "") -> list[str]:
    """What installing the CRD says about its `default:` values, each checked as written."""
    errors: list[str] = []
    if "default" in schema:
        where = f"{path or '<root>'}.default"
        value = schema["default"]
        errors += [f"{where}: {e}" for e in _schema_errors(schema, value) or cel_errors(schema, value)]
    for name, prop in (schema.get("properties") or {}).items():
        errors += default_errors(prop, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        errors += default_errors(schema["items"], f"{path}[]")
    return errors


def admit(obj: dict[str, Any], schema: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """What `kubectl apply` would meet: the defaulted object and the API server's complaints."""
    schema = schema or openapi_schema()
    obj = apply_defaults(schema, copy.deepcopy(obj))
    return obj, _schema_errors(schema, obj) or cel_errors(schema, obj)


def inference_service(spec: dict[str, Any], name: str = "llama", namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace, "uid": "uid-1", "generation": 1},
        "spec": spec,
    }
