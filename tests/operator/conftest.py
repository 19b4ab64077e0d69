"""Offline stand-ins for what the API server does with an InferenceService: structural
defaulting, OpenAPI validation (jsonschema) and the CEL rules (cel-python)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.serving.kvpilot.io.yaml"

Validator = Callable[[dict[str, Any]], list[str]]


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def openapi_schema() -> dict[str, Any]:
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


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


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        result = _cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, celpy.CELEvalError) or not bool(result):
            errors.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, prop in (schema.get("properties") or {}).items():
            if name in value:
                errors += cel_errors(prop, value[name], f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def admit(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What `kubectl apply` would meet: the defaulted object and the API server's complaints."""
    schema = openapi_schema()
    obj = apply_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft202012Validator(to_json_schema(schema))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]
    if not errors:
        errors = cel_errors(schema, obj)
    return obj, errors


def inference_service(spec: dict[str, Any], name: str = "llama", namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace, "uid": "uid-1", "generation": 1},
        "spec": spec,
    }


@pytest.fixture
def crd() -> dict[str, Any]:
    return load_crd()


@pytest.fixture
def schema() -> dict[str, Any]:
    return openapi_schema()


@pytest.fixture
def admission() -> Callable[[dict[str, Any]], tuple[dict[str, Any], list[str]]]:
    return admit


@pytest.fixture
def make_isvc() -> Callable[..., dict[str, Any]]:
    return inference_service
