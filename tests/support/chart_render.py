"""The kvpilot chart rendered by Helm's own engine (helm-python-sdk), as the tests see it."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import helm_python
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpilot"
SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE, NAMESPACE = "kvpilot", "kvpilot-system"


@cache
def chart() -> Any:
    return helm_python.Chart.load(CHART)


def scenario_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    rendered = chart().render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def rules_file(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The PrometheusRule's groups as a Prometheus rules file (what promtool reads)."""
    (rule,) = of_kind(render({**(values or {}), "alerts": {**(values or {}).get("alerts", {}), "enabled": True}}),
                      "PrometheusRule")
    return {"groups": rule["spec"]["groups"]}
