"""The chart's monitoring objects: off by default, each switched by its own `.enabled`; the
prometheus-operator kinds valid against their published field layout in every ci/ scenario;
the dashboard complete (every panel the issue names, decisions as annotations) and well formed
for Grafana's sidecar; and bad values refused by the values schema."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python
import pytest
from chart_render import CHART, SCENARIOS, of_kind, render, scenario_values
from monitoring_crds import MODELS, monitoring_problems
from promql_check import dashboard_expressions, selectors

DASHBOARD = json.loads((CHART / "dashboards" / "kvpilot.json").read_text())
MONITORING_ON = {"engineMonitoring": {"enabled": True}, "dashboards": {"enabled": True}, "alerts": {"enabled": True}}


def _metrics_read(where_prefix: str) -> set[str]:
    return {s.metric for where, expr in dashboard_expressions(DASHBOARD) if where.startswith(where_prefix)
            for s in selectors(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", expr))}


def test_monitoring_objects_are_off_by_default() -> None:
    docs = render()
    assert of_kind(docs, "PrometheusRule") == [] and of_kind(docs, "ConfigMap") == []


@pytest.mark.parametrize(("switch", "kind"), [("alerts", "PrometheusRule"), ("dashboards", "ConfigMap")])
def test_each_object_has_its_own_switch(switch: str, kind: str) -> None:
    docs = render({switch: {"enabled": True}})
    assert len(of_kind(docs, kind)) == 1
    assert {d["kind"] for d in docs} - {kind} == {d["kind"] for d in render()}


def test_a_scenario_turns_all_monitoring_on() -> None:
    values = [scenario_values(p) for p in SCENARIOS]
    assert any(all(v.get(k, {}).get("enabled") for k in MONITORING_ON) for v in values)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.name)
def test_prometheus_operator_objects_match_the_published_layout(scenario: Path) -> None:
    docs = [d for d in render(scenario_values(scenario)) if d["kind"] in MODELS]
    assert {d["kind"]: monitoring_problems(d) for d in docs} == {d["kind"]: [] for d in docs}


def test_operator_service_monitor_keeps_the_series_own_labels() -> None:
    """Operator series carry the InferenceService's namespace and the engine's pod; without
    honorLabels Prometheus would overwrite them with the operator pod's own."""
    monitor, = of_kind(render({"metrics": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor")
    assert all(e["honorLabels"] is True for e in monitor["spec"]["endpoints"])


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar() -> None:
    configmap, = of_kind(render({"dashboards": {"enabled": True, "namespace": "monitoring", "folder": "LLM"}}),
                         "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(configmap["data"]["kvpilot.json"]) == DASHBOARD


def test_dashboard_shows_every_signal_the_issue_names() -> None:
    panels = _metrics_read("panel")
    assert {
        "kvpilot_kv_cache_usage_ratio", "kvpilot_num_running_seqs", "kvpilot_num_waiting_seqs",
        "kvpilot_num_swapped_seqs", "kvpilot_preemptions_total", "kvpilot_swap_bytes_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:generation_tokens_total", "kvpilot_iteration_time_seconds_bucket", "kvpilot_block_size",
        "kvpilot_preemption_mode", "kvpilot_operator_desired_replicas", "up",
    } <= panels
    assert {"kvpilot_operator_tuning_decisions_total", "kvpilot_operator_tuning_rollbacks_total",
            "kvpilot_operator_scaling_decisions_total"} <= _metrics_read("annotation")


def test_dashboard_is_well_formed() -> None:
    assert DASHBOARD["uid"] and len(DASHBOARD["uid"]) <= 40
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert variables == {"datasource", "namespace", "name", "pod"}
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]
    used = set(re.findall(r"\$\{?(\w+)", json.dumps(DASHBOARD))) - {"__rate_interval", "__interval", "__range"}
    assert used <= variables


@pytest.mark.parametrize("values", [
    {"alerts": {"kvCacheUsageThreshold": 1.5}},
    {"alerts": {"kvCacheUsageFor": "ten minutes"}},
    {"alerts": {"iterationTimeSpikeFactor": 1}},
    {"alerts": {"runbookUrl": "docs/runbook.md"}},
    {"alerts": {"labels": {"release": "not a label value"}}},
    {"engineMonitoring": {"interval": "15"}},
    {"engineMonitoring": {"labels": {"bad key!": "x"}}},
    {"dashboards": {"namespace": "Not_A_Namespace"}},
    {"dashboards": {"enabeld": True}},
    {"runtimeImage": ""},
])
def test_values_schema_rejects_bad_monitoring_values(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        render(values)
