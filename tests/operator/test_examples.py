"""Every examples/*.yaml is admitted by the CRD and turns into valid Kubernetes objects."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvpilot.operator.manifests import (
    Owner,
    build_admin_secret,
    build_deployment,
    build_pdb,
    build_service,
)
from kvpilot.operator.reconcile import parse

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_admitted_by_the_crd(path: Path,
                                        admission: Callable[[dict[str, Any]], tuple[dict[str, Any], list[str]]]) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        assert doc["kind"] == "InferenceService"
        assert admission(doc)[1] == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_builds_valid_children(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        doc["metadata"].update(namespace="default", uid="uid")
        desired = parse(doc)
        owner: Owner = desired.owner
        for obj in (build_deployment(owner, desired.spec, desired.source, "kvpilot:test"),
                    build_service(owner), build_admin_secret(owner, "t"), build_pdb(owner, desired.spec)):
            kubernetes_validate.validate(obj, desired_version="1.33", strict=True)


def test_awq_example_asks_its_pods_for_awq_weights() -> None:
    doc = yaml.safe_load((EXAMPLES[0].parent / "llama-3-8b-awq.yaml").read_text())
    doc["metadata"].update(namespace="default", uid="uid")
    desired = parse(doc)
    args = build_deployment(desired.owner, desired.spec, desired.source, "kvpilot:test")["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--quantization") + 1] == "awq"
