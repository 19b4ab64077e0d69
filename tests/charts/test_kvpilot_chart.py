"""The Helm chart: renders for every ci/ scenario, lints, enforces its values schema, ships the
CRDs byte-identical to crds/, and every object it renders is valid Kubernetes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvpilot.operator.kube import RESOURCES

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpilot"
SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))
CUSTOM_KINDS = {"KopfPeering", "ClusterKopfPeering", "ServiceMonitor", "PrometheusRule"}


@pytest.fixture(scope="module")
def chart() -> Any:
    return helm_python.Chart.load(CHART)


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    rendered = chart.render(values or {}, name="kvpilot", namespace="kvpilot-system", is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _scenario(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _args(docs: list[dict[str, Any]]) -> list[str]:
    args: list[str] = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_there_are_ci_scenarios() -> None:
    assert {p.name for p in SCENARIOS} >= {"default-values.yaml", "namespaced-values.yaml", "ha-values.yaml"}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.name)
def test_every_rendered_object_is_valid(chart: Any, scenario: Path) -> None:
    crd_schemas = {yaml.safe_load(c["data"])["spec"]["names"]["kind"]: yaml.safe_load(c["data"])
                   for c in chart.crds}
    for doc in render(chart, _scenario(scenario)):
        if doc["kind"] in crd_schemas:
            schema = crd_schemas[doc["kind"]]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            jsonschema.validate(doc, {k: v for k, v in schema.items() if not k.startswith("x-")})
        elif doc["kind"] not in CUSTOM_KINDS:
            for version in ("1.30", "1.37"):
                kubernetes_validate.validate(doc, desired_version=version, strict=True)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.name)
def test_lint_is_clean(scenario: Path) -> None:
    result = helm_python.lint(CHART, _scenario(scenario), strict=True)
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] > 1] == []


def test_crds_are_byte_identical_to_the_source_of_truth() -> None:
    source = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    copy = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert copy == source


def test_every_value_is_documented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w-]*:", line):
            previous = next((p for p in reversed(lines[:i]) if p.strip()), "")
            if not previous.strip().startswith("##"):
                undocumented.append(line.strip())
    assert undocumented == []


@pytest.mark.parametrize("values", [
    {"replicaCount": 0},
    {"watchNamespaces": "default"},
    {"watchNamespaces": ["Not_A_Namespace"]},
    {"logLevel": "loud"},
    {"image": {"pullPolicy": "Sometimes"}},
    {"unknownKey": 1},
])
def test_values_schema_rejects_bad_values(chart: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        render(chart, values)


def test_default_watches_all_namespaces_standalone(chart: Any) -> None:
    docs = render(chart)
    assert "--all-namespaces" in _args(docs) and "--standalone" in _args(docs)
    assert not [d for d in docs if d["kind"] in ("Role", "KopfPeering", "ClusterKopfPeering", "ServiceMonitor")]


def test_namespaced_install_gets_one_role_per_namespace(chart: Any) -> None:
    docs = render(chart, {"watchNamespaces": ["a", "b"]})
    assert [a for a in _args(docs) if a.startswith("--namespace")] == ["--namespace=a", "--namespace=b"]
    assert sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "Role") == ["a", "b"]
    assert sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "RoleBinding") == ["a", "b"]
    cluster_rules = _one(docs, "ClusterRole")["rules"]
    assert not [r for r in cluster_rules if "deployments" in r["resources"]]


def test_more_than_one_replica_peers(chart: Any) -> None:
    docs = render(chart, {"replicaCount": 2})
    assert "--peering=kvpilot" in _args(docs)
    assert _one(docs, "ClusterKopfPeering")["metadata"]["name"] == "kvpilot"
    namespaced = render(chart, {"replicaCount": 2, "watchNamespaces": ["a"]})
    assert _one(namespaced, "KopfPeering")["metadata"]["namespace"] == "a"


def test_rbac_covers_every_kind_the_operator_writes(chart: Any) -> None:
    rules = _one(render(chart), "ClusterRole")["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    needed = {"inferenceservices": ("get", "list", "watch", "patch"), "events": ("create",),
              "pods": ("get", "list", "watch", "patch")}
    for prefix, plural in RESOURCES.values():
        group = prefix.split("/")[2] if prefix.startswith("/apis/") else ""
        for verb in needed.get(plural, ("get", "list", "watch", "create", "update", "patch", "delete")):
            assert (group, plural, verb) in granted, (group, plural, verb)
    assert ("serving.kvpilot.io", "inferenceservices/status", "patch") in granted
    assert ("serving.kvpilot.io", "inferenceservices/scale", "patch") in granted
    # children with blockOwnerDeletion, under the OwnerReferencesPermissionEnforcement admission plugin
    assert ("serving.kvpilot.io", "inferenceservices/finalizers", "update") in granted


def test_operator_is_ready_only_while_it_reaches_the_api_server(chart: Any) -> None:
    container = _one(render(chart), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_operator_pod_is_locked_down(chart: Any) -> None:
    pod = _one(render(chart), "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["command"] == ["kvpilot", "operator"]


def test_engine_monitoring_and_keda_values_become_operator_flags_it_accepts(chart: Any) -> None:
    import argparse

    from kvpilot.operator import cli, monitoring

    values = {**_scenario(CHART / "ci" / "monitoring-values.yaml"), **_scenario(CHART / "ci" / "autoscaling-values.yaml")}
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(_args(render(chart, values)))
    engine = monitoring.from_args(args)
    assert (engine.enabled, engine.interval, engine.scrape_timeout) == (True, "10s", "5s")
    assert dict(engine.labels) == {"release": "kube-prometheus-stack"}
    assert args.prometheus_address == "http://prometheus-operated.monitoring.svc:9090"
    off = parser.parse_args(_args(render(chart)))
    assert not off.engine_monitoring and off.prometheus_address is None


def test_engine_cache_value_becomes_the_operator_flag(chart: Any) -> None:
    import argparse

    from kvpilot.operator import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    shared = parser.parse_args(_args(render(chart, {"engineCache": {"hostPath": "/var/cache/kvpilot"}})))
    assert shared.engine_cache_host_path == "/var/cache/kvpilot"
    assert parser.parse_args(_args(render(chart))).engine_cache_host_path is None
    with pytest.raises(helm_python.HelmValuesError):
        render(chart, {"engineCache": {"hostPath": "relative/path"}})
