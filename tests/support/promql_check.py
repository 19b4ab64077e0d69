"""Which metrics a PromQL expression reads, as Prometheus's own grammar parses it.

`promql-parser` (a Rust port of Prometheus's parser) turns each expression into a syntax tree;
every vector selector in it names a metric (or matches `__name__`) and a set of label matchers.
`check` reports each name that no exporter gives and each matcher on a label the metric does
not carry, so a misspelt `kvpilot_kv_cache_usage_ration` in an alert or a panel fails a test.

Grafana dashboards add their own syntax around PromQL: `$__rate_interval` and friends become a
plain duration here, `$var` inside a quoted matcher value is already valid PromQL, and
`label_values(selector, label)` is checked as its selector plus that label.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import promql_parser

_GRAFANA_INTERVALS = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.*),\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S)


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: frozenset[str]


def selectors(expr: str) -> list[Selector]:
    """Every vector selector in `expr`; ValueError when it is not valid PromQL."""
    tree = promql_parser.parse(_GRAFANA_INTERVALS.sub("5m", expr))
    found: list[Selector] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = {m.name: m.value for m in node.matchers.matchers}
            name = node.name or matchers.get("__name__", "")
            found.append(Selector(name, frozenset(k for k in matchers if k != "__name__")))

    promql_parser.walk(tree, visit)
    return found


def check(expr: str, known: Mapping[str, frozenset[str] | None]) -> list[str]:
    """Problems with `expr` against `known` (metric -> its labels, None: labels not checked)."""
    label_values = _LABEL_VALUES.match(expr)
    extra_label = None
    if label_values:
        expr, extra_label = label_values["selector"], label_values["label"]
    try:
        found = selectors(expr)
    except ValueError as exc:
        return [f"does not parse: {exc}"]
    problems = []
    for selector in found:
        if selector.metric not in known:
            problems.append(f"{selector.metric or '(no metric name)'}: no such metric")
            continue
        labels = known[selector.metric]
        wanted = selector.labels | ({extra_label} if extra_label else set())
        if labels is not None and wanted - labels:
            problems.append(f"{selector.metric}: no label {sorted(wanted - labels)}")
    return problems


def rule_expressions(rules: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    for group in rules["groups"]:
        for rule in group["rules"]:
            yield rule.get("alert") or rule["record"], rule["expr"]


def recorded_metrics(rules: Mapping[str, Any]) -> set[str]:
    return {rule["record"] for group in rules["groups"] for rule in group["rules"] if "record" in rule}


def dashboard_expressions(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expression) for every panel target, annotation and templating query."""
    def panels(items: list[Any]) -> Iterator[Any]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            yield f"annotation {annotation['name']!r}", annotation["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            yield f"variable {variable['name']!r}", query["query"] if isinstance(query, dict) else query
