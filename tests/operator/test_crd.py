"""The CRD: names, subresources, columns, defaults that agree with the operator's, and
specs the API server must reject, each with the schema's own message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from crd_admission import CEL_REJECTS, MODEL, SCHEMA_REJECTS, SOUND_SPECS, default_errors

from kvpilot.operator.spec import InferenceServiceSpec

Admission = Callable[[dict[str, Any]], tuple[dict[str, Any], list[str]]]


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


@pytest.mark.parametrize(("spec", "message"), SCHEMA_REJECTS)
def test_schema_rejects(admission: Admission, make_isvc: Callable[..., Any], spec: dict[str, Any],
                        message: str) -> None:
    errors = admission(make_isvc({**MODEL, **spec}))[1]
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize(("spec", "message"), CEL_REJECTS)
def test_cel_rules_reject(admission: Admission, make_isvc: Callable[..., Any], spec: dict[str, Any],
                          message: str) -> None:
    errors = admission(make_isvc({**MODEL, **spec}))[1]
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("spec", SOUND_SPECS)
def test_cross_field_rules_admit_sound_specs(admission: Admission, make_isvc: Callable[..., Any],
                                             spec: dict[str, Any]) -> None:
    assert admission(make_isvc({**MODEL, **spec}))[1] == []


def test_every_default_is_valid_as_written(schema: dict[str, Any]) -> None:
    """The API server refuses to install a CRD whose `default: {}` breaks a rule of its node
    before the nested defaults fill it in."""
    assert default_errors(schema) == []


def test_a_rule_reading_a_field_its_default_lacks_is_caught() -> None:
    """The check above can fail: the rule the API server once refused, without has() guards."""
    node = {"type": "object", "default": {},
            "x-kubernetes-validations": [{"rule": "self.preStopSeconds < self.gracePeriodSeconds",
                                          "message": "preStopSeconds must be < gracePeriodSeconds"}],
            "properties": {"preStopSeconds": {"type": "integer", "default": 5},
                           "gracePeriodSeconds": {"type": "integer", "default": 120}}}
    assert default_errors({"type": "object", "properties": {"drain": node}}) == [
        "drain.default: <root>: preStopSeconds must be < gracePeriodSeconds"]


def _shown(value: Any) -> str:
    """A value as the descriptions write it: true, 0.9, [8, 16, 32], [recompute, swap]."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_every_field_says_what_it_is_its_default_and_range(schema: dict[str, Any]) -> None:
    """`kubectl explain` shows the description: one line with the default and the bounds."""
    missing = []
    for path, node in _walk(schema, ""):
        if not path or path.endswith("[]") or path.endswith("{}") or path.startswith(".metadata"):
            continue
        text = node.get("description", "")
        wanted = [] if isinstance(node.get("default"), dict) else \
            [f"Default {_shown(node['default'])}."] if "default" in node else []
        wanted += [_shown(node[bound]) for bound in ("minimum", "maximum", "maxItems", "maxLength") if bound in node]
        if not text or "\n" in text.strip() or any(w not in text for w in wanted):
            missing.append((path, text, wanted))
    assert missing == []


def test_name_longer_than_children_allow_is_rejected(admission: Admission, make_isvc: Callable[..., Any]) -> None:
    errors = admission(make_isvc(MODEL, name="x" * 51))[1]
    assert any("at most 50 characters" in e for e in errors)
