"""The chart's PrometheusRule, checked by Prometheus's own promtool: the rules load for every ci/
scenario, each alert fires on a series that should fire and stays quiet on one that should not
(tests/charts/rules/*.test.yaml), and each alert has its runbook entry."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_render import ROOT, SCENARIOS, rules_file, scenario_values

UNIT_TESTS = Path(__file__).parent / "rules" / "kvpilot-alerts.test.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"
# what an alert is about: the labels that tell one service or pod from another
IDENTITY = ("namespace", "name", "pod")


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found: it comes with Debian's prometheus package (.ci/install-tools)")
    return promtool


def _alerts(rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for group in rules["groups"] for r in group["rules"] if "alert" in r]


def _write_rules(folder: Path, values: dict[str, Any]) -> Path:
    path = folder / "kvpilot-rules.yaml"
    path.write_text(yaml.safe_dump(rules_file(values), sort_keys=False))
    return path


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.name)
def test_promtool_loads_the_rules_of_every_scenario(scenario: Path, tmp_path: Path) -> None:
    rules = _write_rules(tmp_path, scenario_values(scenario))
    result = subprocess.run([_promtool(), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    _write_rules(tmp_path, {})
    shutil.copy(UNIT_TESTS, tmp_path)
    result = subprocess.run([_promtool(), "test", "rules", UNIT_TESTS.name], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_alert_fails_the_unit_tests(tmp_path: Path) -> None:
    """The unit tests can fail: a threshold above the firing series' value silences an alert."""
    _write_rules(tmp_path, {"alerts": {"kvCacheUsageThreshold": 0.95}})
    shutil.copy(UNIT_TESTS, tmp_path)
    result = subprocess.run([_promtool(), "test", "rules", UNIT_TESTS.name], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode != 0
    assert "KvpilotKVCacheHigh" in result.stdout + result.stderr


def _covers(fired: dict[str, str], series_labels: dict[str, str]) -> bool:
    return all(series_labels.get(k) == fired[k] for k in IDENTITY if k in fired)


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    for alert in _alerts(rules_file()):
        name = alert["alert"]
        cases = [(t, c) for t in tests for c in t.get("alert_rule_test", []) if c["alertname"] == name]
        fired = [e["exp_labels"] for _, c in cases for e in c["exp_alerts"]]
        assert fired, f"{name}: no case where it fires"
        inputs = [dict(re.findall(r'(\w+)="([^"]*)"', s["series"])) for t, _ in cases for s in t["input_series"]]
        # a time when it must not fire, or a service or pod in the input that it must not fire for
        quiet = any(not c["exp_alerts"] for _, c in cases) or any(
            not any(_covers(f, labels) for f in fired) for labels in inputs)
        assert quiet, f"{name}: no case where it stays quiet"


def test_every_alert_names_a_severity_and_its_runbook_entry() -> None:
    headings = {m.lower() for m in re.findall(r"^## (\w+)\s*$", RUNBOOK.read_text(), re.M)}
    alerts = _alerts(rules_file())
    assert len(alerts) == 7
    for alert in alerts:
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}
        url = alert["annotations"]["runbook_url"]
        assert url.endswith(f"/docs/runbook.md#{alert['alert'].lower()}")
        assert alert["alert"].lower() in headings, f"{alert['alert']} has no entry in docs/runbook.md"
    assert headings == {a["alert"].lower() for a in alerts}, "a runbook entry for an alert the chart lacks"


def test_alert_settings_reach_the_rules() -> None:
    rules = rules_file({"alerts": {"kvCacheUsageThreshold": 0.7, "kvCacheUsageFor": "3m",
                                   "alertLabels": {"team": "ml-platform"}}})
    alert, = [a for a in _alerts(rules) if a["alert"] == "KvpilotKVCacheHigh"]
    assert alert["expr"].strip().endswith("> 0.7")
    assert alert["for"] == "3m"
    assert all(a["labels"]["team"] == "ml-platform" for a in _alerts(rules))
