"""Every metric the chart's alerts and dashboard read is one that a live `kvpilot serve` or the
operator exports, with the labels they select on; and Prometheus's own linter accepts the
engine's /metrics page."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from chart_render import CHART, rules_file
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from promql_check import check, dashboard_expressions, recorded_metrics, rule_expressions
from server_harness import start_server

from kvpilot.operator import metrics as operator_metrics
from kvpilot.operator.manifests import Owner
from kvpilot.operator.monitoring import EngineMonitoring, build_pod_monitor

# What prometheus-operator puts on every target it generates, besides the relabelings' own.
POD_MONITOR_TARGET_LABELS = frozenset({"instance", "job", "namespace", "pod", "container", "endpoint"})
SERVICE_MONITOR_TARGET_LABELS = POD_MONITOR_TARGET_LABELS | {"service"}
# Sample names of each metric type in the text exposition format.
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created")}
# The names promtool's linter flags only for their colon: vLLM's own, kept on purpose so that vLLM
# dashboards, KEDA/HPA adapters and scrapers work unchanged (ARCHITECTURE.md, Metrics).
VLLM_COLON_LINT = "metric names should not contain ':'"


def engine_target_labels() -> frozenset[str]:
    pod_monitor = build_pod_monitor(Owner("x", "y", "z"), EngineMonitoring())
    endpoint, = pod_monitor["spec"]["podMetricsEndpoints"]
    return POD_MONITOR_TARGET_LABELS | {r["targetLabel"] for r in endpoint["relabelings"]}


@pytest.fixture(scope="module")
def metrics_page() -> Iterator[str]:
    """/metrics of a live server (the embedded model on CPU) after one request, so that every
    series, the per-request ones included, has a sample."""
    server = start_server({"max_model_len": 512, "max_num_seqs": 2})
    try:
        model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
        reply = httpx.post(f"{server.base_url}/v1/completions",
                           json={"model": model, "prompt": "Hello", "max_tokens": 3}, timeout=120)
        assert reply.status_code == 200, reply.text
        yield httpx.get(f"{server.base_url}/metrics").text
    finally:
        server.stop()


def engine_metrics(page: str) -> dict[str, frozenset[str] | None]:
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    target = engine_target_labels()
    return {name: frozenset(labels) | target for name, labels in found.items()}


def operator_metric_names() -> dict[str, frozenset[str] | None]:
    found: dict[str, frozenset[str] | None] = {}
    for metric in vars(operator_metrics).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        # A labelled series appears only once the operator first sets it, so its label names
        # come from the definition rather than from a scrape.
        labels = frozenset(metric._labelnames) | SERVICE_MONITOR_TARGET_LABELS
        for family in metric.describe():
            for suffix in SUFFIXES[family.type]:
                found[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return found


@pytest.fixture(scope="module")
def known(metrics_page: str) -> dict[str, frozenset[str] | None]:
    rules = rules_file()
    return {
        **engine_metrics(metrics_page),
        **operator_metric_names(),
        # Prometheus's own health series of every target it scrapes
        "up": engine_target_labels() | SERVICE_MONITOR_TARGET_LABELS,
        # the chart's recording rules; their labels are whatever their expressions keep
        **dict.fromkeys(recorded_metrics(rules)),
    }


def _dashboard() -> dict[str, Any]:
    return json.loads((CHART / "dashboards" / "kvpilot.json").read_text())


def test_every_alert_and_recording_rule_reads_exported_metrics(known: dict[str, frozenset[str] | None]) -> None:
    problems = {where: p for where, expr in rule_expressions(rules_file()) if (p := check(expr, known))}
    assert problems == {}


def test_every_dashboard_query_reads_exported_metrics(known: dict[str, frozenset[str] | None]) -> None:
    expressions = list(dashboard_expressions(_dashboard()))
    assert len(expressions) > 20
    problems = {where: p for where, expr in expressions if (p := check(expr, known))}
    assert problems == {}


@pytest.mark.parametrize(("planted", "problem"), [
    (("kvpilot_kv_cache_usage_ratio{", "kvpilot_kv_cache_usage_ration{"), "kvpilot_kv_cache_usage_ration: no such metric"),
    (('job="kvpilot-engine"', 'jobb="kvpilot-engine"'), "kvpilot_kv_cache_usage_ratio: no label ['jobb']"),
    ((") > 0.85", " > 0.85"), "does not parse"),
])
def test_a_planted_typo_is_caught(known: dict[str, frozenset[str] | None], planted: tuple[str, str],
                                  problem: str) -> None:
    expr = dict(rule_expressions(rules_file()))["KvpilotKVCacheHigh"]
    assert check(expr, known) == []
    problems = check(expr.replace(*planted), known)
    assert problems and problems[0].startswith(problem)


def test_the_operator_exports_the_decision_metrics_the_chart_reads() -> None:
    names = operator_metric_names()
    service = {"namespace", "name"}
    for metric, labels in {
        "kvpilot_operator_scrapes_total": service | {"result"},
        "kvpilot_operator_tuning_decisions_total": service | {"outcome"},
        "kvpilot_operator_tuning_rollbacks_total": service,
        "kvpilot_operator_scaling_decisions_total": service | {"direction"},
        "kvpilot_operator_desired_replicas": service,
        "kvpilot_operator_live_block_size": service | {"pod"},
    }.items():
        assert labels <= (names[metric] or set()), metric


def test_promtool_accepts_the_live_metrics_page(metrics_page: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found: it comes with Debian's prometheus package (.ci/install-tools)")
    result = subprocess.run([promtool, "check", "metrics"], input=metrics_page, text=True,
                            capture_output=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    unexpected = [p for p in problems if not (p.startswith("vllm:") and p.endswith(VLLM_COLON_LINT))]
    assert unexpected == []
    assert any(p.endswith(VLLM_COLON_LINT) for p in problems) == (result.returncode != 0)
