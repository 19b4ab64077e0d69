"""What modes hpa and keda create: the HPA valid against the Kubernetes schema, the ScaledObject
against KEDA's field layout, both on the InferenceService's scale subresource with the spec's
behavior; their PromQL parses; the chart's prometheus-adapter rules expose the names the HPA
asks for; discovery tells when KEDA or the custom metrics API is missing."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvpilot.operator.autoscale import (
    METRICS,
    Behavior,
    MissingApi,
    ScalingPolicy,
    ScalingRules,
    ScalingSpec,
    build_hpa,
    build_scaled_object,
    missing_api,
    scaling_condition,
)
from kvpilot.operator.autoscale.engine_series import SERIES, service_selector

ROOT = Path(__file__).resolve().parents[2]
KEDA_SCHEMA = json.loads((Path(__file__).parent / "data" / "keda-scaledobject-v1alpha1.schema.json").read_text())
TARGET_REF = {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "InferenceService", "name": "chat"}
TARGETS = {"kvCacheUsage": 0.85, "waitingPerReplica": 4, "preemptionRate": 0.5, "ttftP99": 0.5}
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"


def metadata() -> dict[str, Any]:
    return {"name": "chat", "namespace": "team-a",
            "labels": {"app.kubernetes.io/managed-by": "kvpilot-operator"},
            "ownerReferences": [{"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "InferenceService",
                                 "name": "chat", "uid": "2b9c5d4e-0000-4000-8000-000000000001",
                                 "controller": True, "blockOwnerDeletion": True}]}


def spec(metric: str, **fields: Any) -> ScalingSpec:
    return ScalingSpec(enabled=True, metric=metric, target=TARGETS[metric], min_replicas=1, max_replicas=8,  # type: ignore[arg-type]
                       **fields)


def promql_errors(queries: list[str], folder: Path) -> str:
    """promtool's complaints about `queries` as recording rules; empty when all parse."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    rules = {"groups": [{"name": "check", "rules": [{"record": f"check:q{i}", "expr": q}
                                                    for i, q in enumerate(queries)]}]}
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    return "" if result.returncode == 0 else result.stdout + result.stderr


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_the_hpa_is_valid_kubernetes(metric: str, version: str) -> None:
    kubernetes_validate.validate(build_hpa("chat", spec(metric, mode="hpa"), metadata()), desired_version=version,
                                 strict=True)


def test_the_hpa_scales_the_inference_service_on_a_pods_metric_named_like_vllms() -> None:
    hpa = build_hpa("chat", spec("waitingPerReplica", mode="hpa"), metadata())
    assert hpa["spec"]["scaleTargetRef"] == TARGET_REF
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 8)
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "vllm_num_requests_waiting"}, "target": {"type": "AverageValue", "averageValue": "4"}}}]
    assert hpa["metadata"] == metadata()
    kv = build_hpa("chat", spec("kvCacheUsage", mode="hpa"), metadata())["spec"]["metrics"][0]
    assert kv["pods"]["metric"]["name"] == "vllm_kv_cache_usage_perc"
    assert kv["pods"]["target"]["averageValue"] == "850m"


def test_the_hpa_reads_p99_ttft_as_one_value_of_the_inference_service() -> None:
    metric = build_hpa("chat", spec("ttftP99", mode="hpa"), metadata())["spec"]["metrics"][0]
    assert metric == {"type": "Object", "object": {
        "describedObject": TARGET_REF, "metric": {"name": "vllm_time_to_first_token_seconds_p99"},
        "target": {"type": "Value", "value": "500m"}}}


def test_the_hpa_carries_the_behavior_as_given() -> None:
    default = build_hpa("chat", spec("kvCacheUsage", mode="hpa"), metadata())["spec"]["behavior"]
    assert default == {
        "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max", "policies": [
            {"type": "Percent", "value": 100, "periodSeconds": 15}, {"type": "Pods", "value": 4, "periodSeconds": 15}]},
        "scaleDown": {"stabilizationWindowSeconds": 300, "selectPolicy": "Max", "policies": [
            {"type": "Percent", "value": 100, "periodSeconds": 15}]}}
    slow = Behavior(scale_down=ScalingRules(600, (ScalingPolicy("Pods", 1, 120),), "Min"))
    custom = build_hpa("chat", spec("kvCacheUsage", mode="hpa", behavior=slow), metadata())["spec"]["behavior"]
    assert custom["scaleDown"] == {"stabilizationWindowSeconds": 600, "selectPolicy": "Min",
                                   "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]}


def test_a_tolerance_other_than_the_clusters_needs_kubernetes_1_33() -> None:
    hpa = build_hpa("chat", spec("kvCacheUsage", mode="hpa", tolerance=0.05), metadata())
    assert hpa["spec"]["behavior"]["scaleUp"]["tolerance"] == "50m"
    for version in ("1.33", "1.37"):
        kubernetes_validate.validate(hpa, desired_version=version, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, desired_version="1.30", strict=True)


@pytest.mark.parametrize("metric", METRICS)
def test_the_scaled_object_matches_kedas_layout(metric: str) -> None:
    obj = build_scaled_object("chat", spec(metric, mode="keda"), metadata(), default_prometheus_address=PROMETHEUS)
    jsonschema.validate(obj, KEDA_SCHEMA)
    # KEDA hands the behavior to the HPA it creates: it must be a valid HPA behavior
    behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa = build_hpa("chat", spec(metric, mode="hpa"), metadata())
    kubernetes_validate.validate({**hpa, "spec": {**hpa["spec"], "behavior": behavior}}, desired_version="1.30",
                                 strict=True)


def test_the_schema_is_strict_enough_to_catch_a_misplaced_field() -> None:
    obj = build_scaled_object("chat", spec("waitingPerReplica", mode="keda"), metadata(),
                              default_prometheus_address=PROMETHEUS)
    obj["spec"]["behavior"] = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"].pop("behavior")
    with pytest.raises(jsonschema.ValidationError, match="behavior"):
        jsonschema.validate(obj, KEDA_SCHEMA)
    trigger = build_scaled_object("chat", spec("waitingPerReplica", mode="keda"), metadata(),
                                  default_prometheus_address=PROMETHEUS)
    trigger["spec"]["triggers"][0]["metadata"]["threshold"] = 4
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(trigger, KEDA_SCHEMA)


def test_the_scaled_object_queries_the_services_engines() -> None:
    keda = spec("waitingPerReplica", mode="keda", window_s=30, interval_s=10, prometheus_address="http://prom:9090")
    obj = build_scaled_object("chat", keda, metadata(), default_prometheus_address=PROMETHEUS)
    assert obj["spec"]["scaleTargetRef"] == TARGET_REF
    assert (obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"], obj["spec"]["pollingInterval"]) == (1, 8, 10)
    assert obj["spec"]["triggers"] == [{"type": "prometheus", "name": "waitingPerReplica", "metricType": "AverageValue",
                                        "metadata": {"serverAddress": "http://prom:9090", "threshold": "4",
                                                     "query": 'sum(avg_over_time(vllm:num_requests_waiting'
                                                              '{job="kvpilot-engine",namespace="team-a",name="chat"}[30s]))'}}]
    ttft = build_scaled_object("chat", spec("ttftP99", mode="keda"), metadata(), default_prometheus_address=PROMETHEUS)
    assert ttft["spec"]["triggers"][0]["metricType"] == "Value"
    assert ttft["spec"]["pollingInterval"] == 15


def test_keda_needs_a_prometheus_address() -> None:
    with pytest.raises(ValueError, match="prometheus_address: mode keda needs a Prometheus"):
        build_scaled_object("chat", spec("kvCacheUsage", mode="keda"), metadata(), default_prometheus_address=None)


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    selector = service_selector("team-a", "chat")
    assert promql_errors([s.service_query(selector, 60) for s in SERIES.values()], tmp_path) == ""


def test_promtool_catches_a_broken_query(tmp_path: Path) -> None:
    assert "parse error" in promql_errors(["sum(rate(vllm:num_preemptions_total[60s])"], tmp_path)


def _adapter_rules(window: str = "1m") -> list[dict[str, Any]]:
    chart = helm_python.Chart.load(ROOT / "charts" / "kvpilot")
    rendered = chart.render({"prometheusAdapterRules": {"enabled": True, "window": window}}, name="kvpilot",
                            namespace="kvpilot-system", is_install=True)
    (text,) = [t for p, t in rendered.items() if p.endswith("prometheus-adapter-rules-configmap.yaml")]
    config_map = yaml.safe_load(text)
    kubernetes_validate.validate(config_map, desired_version="1.30", strict=True)
    rules: list[dict[str, Any]] = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    return rules


def _series_names(series_query: str) -> re.Pattern[str]:
    """The `__name__` matcher of a series query as a (fully anchored) Python pattern."""
    match = re.search(r'__name__(=~|=)"([^"]+)"', series_query)
    assert match is not None, series_query
    op, value = match.groups()
    return re.compile(value if op == "=~" else re.escape(value))


@pytest.mark.parametrize("metric", METRICS)
def test_the_charts_adapter_rules_expose_the_names_the_hpa_reads(metric: str) -> None:
    series = SERIES[metric]  # type: ignore[index]
    rules = [r for r in _adapter_rules() if _series_names(r["seriesQuery"]).fullmatch(series.series)]
    assert len(rules) == 1, f"{series.series} is matched by {len(rules)} rules"
    rule = rules[0]
    exposed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\g<1>"), series.series)
    assert exposed == series.adapter_name
    hpa_metric = build_hpa("chat", spec(metric, mode="hpa"), metadata())["spec"]["metrics"][0]
    overrides = rule["resources"]["overrides"]
    if series.per_pod:
        assert hpa_metric["type"] == "Pods" and overrides["pod"] == {"resource": "pod"}
    else:
        assert hpa_metric["type"] == "Object"
        assert overrides["name"] == {"group": "serving.kvpilot.io", "resource": "inferenceservices"}
    assert 'job="kvpilot-engine"' in rule["seriesQuery"]


def test_the_adapter_queries_parse_as_promql_once_the_adapter_fills_them_in(tmp_path: Path) -> None:
    queries = []
    for rule in _adapter_rules(window="2m"):
        assert "[2m]" in rule["metricsQuery"]
        name = "vllm:num_requests_waiting" if "num_requests_waiting" in rule["seriesQuery"] else (
            re.search(r'__name__="([^"]+)"', rule["seriesQuery"]).group(1))  # type: ignore[union-attr]
        queries.append(rule["metricsQuery"].replace("<<.Series>>", name)
                       .replace("<<.LabelMatchers>>", 'namespace="team-a",pod=~"chat-a|chat-b"')
                       .replace("<<.GroupBy>>", "pod"))
    assert promql_errors(queries, tmp_path) == ""


def _api_groups(*group_versions: str) -> dict[str, Any]:
    groups: dict[str, list[str]] = {}
    for gv in group_versions:
        group, version = gv.split("/")
        groups.setdefault(group, []).append(version)
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
        {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
         "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]}} for g, vs in groups.items()]}


def test_a_cluster_without_keda_gets_a_condition_not_a_failed_reconcile() -> None:
    cluster = _api_groups("apps/v1", "autoscaling/v2", "custom.metrics.k8s.io/v1beta2")
    missing = missing_api(cluster, "keda")
    assert isinstance(missing, MissingApi) and missing.reason == "KedaNotInstalled"
    assert scaling_condition(missing) == {
        "type": "ScalingActive", "status": "False", "reason": "KedaNotInstalled",
        "message": "KEDA is not installed: the API server serves no keda.sh/v1alpha1, so no ScaledObject can be "
                   "created; install KEDA or use mode builtin"}
    assert missing_api(cluster, "hpa") is None and missing_api(cluster, "builtin") is None


def test_keda_is_found_in_either_form_of_discovery() -> None:
    cluster = _api_groups("apps/v1", "keda.sh/v1alpha1", "eventing.keda.sh/v1alpha1")
    assert missing_api(cluster, "keda") is None
    assert scaling_condition(None)["status"] == "True"
    # the kubernetes client's ApisApi().get_api_versions().to_dict(): snake_case, same name/version keys
    snake = {"groups": [{"name": "keda.sh", "versions": [{"group_version": "keda.sh/v1alpha1", "version": "v1alpha1"}],
                         "preferred_version": None, "server_address_by_client_cid_rs": None}]}
    assert missing_api(snake, "keda") is None


def test_hpa_mode_without_a_custom_metrics_api_says_what_to_install() -> None:
    missing = missing_api(_api_groups("apps/v1", "autoscaling/v2", "keda.sh/v1alpha1"), "hpa")
    assert missing is not None and missing.reason == "CustomMetricsUnavailable"
    assert "prometheusAdapterRules.enabled" in missing.message
