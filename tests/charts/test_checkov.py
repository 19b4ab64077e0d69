"""checkov, the scanner platform teams run on manifests, finds nothing in any ci/ scenario's
rendered chart beyond the deliberate choices that charts/kvpilot/.checkov.yaml names with their
reasons; and that list holds nothing stale."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_render import CHART, ROOT, SCENARIOS, render, scenario_values

CONFIG = CHART / ".checkov.yaml"
# where .ci/install-tools puts it: a venv of its own, as its pins clash with the test environment's
CHECKOV_VENV = ROOT / ".venv" / "tools" / "checkov" / "bin" / "checkov"


def _checkov() -> str:
    found = str(CHECKOV_VENV) if CHECKOV_VENV.exists() else shutil.which("checkov")
    if found is None:
        pytest.skip("checkov not found: .ci/install-tools installs it into .venv/tools/checkov")
    return found


def _scan(folder: Path, *options: str) -> list[dict[str, Any]]:
    # --skip-download: checkov otherwise fetches its guideline links from its vendor's cloud
    result = subprocess.run([_checkov(), "--directory", str(folder), "--framework", "kubernetes",
                             "--skip-download", "--output", "json", *options],
                            capture_output=True, text=True, timeout=300, cwd=folder)
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: findings
    reports = json.loads(result.stdout)
    report, = reports if isinstance(reports, list) else [reports]
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["resource_count"] > 0
    failed: list[dict[str, Any]] = report["results"]["failed_checks"]
    return failed


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("rendered")
    for scenario in SCENARIOS:
        docs = render(scenario_values(scenario))
        (folder / scenario.name).write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return folder


def skipped_with_reasons() -> dict[str, str]:
    """check id -> the comment above it (several ids may share one reason)."""
    reasons: dict[str, str] = {}
    comment = ""
    for line in CONFIG.read_text().splitlines():
        if match := re.match(r"^\s*-\s*(CKV2?_\w+)\s*$", line):
            reasons[match[1]] = comment
        elif line.strip().startswith("#") and line.startswith("  "):
            comment = line.strip("# ")
    assert set(reasons) == set(yaml.safe_load(CONFIG.read_text())["skip-check"])
    return reasons


def test_every_skipped_check_gives_its_reason() -> None:
    assert {check: reason for check, reason in skipped_with_reasons().items() if len(reason) < 20} == {}


def test_checkov_finds_nothing_else(rendered: Path) -> None:
    failed = _scan(rendered, "--config-file", str(CONFIG))
    assert [(f["check_id"], f["resource"], Path(f["file_path"]).name) for f in failed] == []


def test_each_skip_is_still_needed_and_only_for_the_operator_deployment(rendered: Path) -> None:
    failed = _scan(rendered)
    assert {f["check_id"] for f in failed} == set(skipped_with_reasons())
    assert {f["resource"].split(".")[0] for f in failed} == {"Deployment"}
