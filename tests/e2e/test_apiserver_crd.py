"""The CRD on a real API server: it installs with kubectl and with helm (conftest), `kubectl
explain` shows each field's default and range, every example is admitted and defaulted exactly as
the offline stand-in (tests/support/crd_admission.py) says, and every bad spec is refused — by a
CEL rule, with that rule's message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_admission import CEL_REJECTS, MODEL, SCHEMA_REJECTS, SOUND_SPECS, admit
from kube_control_plane import ControlPlane, eventually
from kubernetes.client import CustomObjectsApi
from kubernetes.client.exceptions import ApiException

from kvpilot.operator.crd_schema import spec_property
from kvpilot.runtime.tunables import BLOCK_SIZE

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
GROUP, VERSION, PLURAL = "serving.kvpilot.io", "v1alpha1", "inferenceservices"


def _dry_run_create(api: Any, spec: dict[str, Any], name: str = "probe") -> dict[str, Any]:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}
    return CustomObjectsApi(api).create_namespaced_custom_object(  # type: ignore[no-any-return]
        GROUP, VERSION, "default", PLURAL, body, dry_run="All")


def _refusal(api: Any, spec: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as refused:
        _dry_run_create(api, spec)
    assert refused.value.status == 422
    return str(json.loads(refused.value.body)["message"])


def _leaf(spec: dict[str, Any]) -> str:
    """The first field a case sets: `{"engine": {"blockSize": 12}}` -> "blockSize"."""
    key, value = next(iter(spec.items()))
    return _leaf(value) if isinstance(value, dict) and value else key


def test_the_crd_is_established_and_the_chart_installed(control_plane: ControlPlane) -> None:
    crd = control_plane.get("crd", "inferenceservices.serving.kvpilot.io")
    assert crd is not None
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
    releases = control_plane.kubectl("get", "secrets", "-n", "kvpilot-system", "-l", "owner=helm", "-o", "name").stdout
    assert "sh.helm.release.v1.kvpilot.v1" in releases


def test_kubectl_explain_shows_each_fields_default_and_range(control_plane: ControlPlane) -> None:
    # The API server publishes a new CRD's OpenAPI a moment after it is Established.
    explained = eventually(lambda: (done := control_plane.kubectl("explain", "inferenceservice.spec.engine",
                                                                  check=False)).returncode == 0 and done,
                           timeout=30, what="the CRD's OpenAPI to be published")
    engine = " ".join(explained.stdout.split())  # kubectl wraps long descriptions
    assert spec_property(BLOCK_SIZE)["description"] in engine  # the contract's words: the flag's help, rule, default
    assert "One of 8, 16, 32, 64. Default 16." in engine
    assert "Default true." in engine  # enableChunkedPrefill: the runtime's default
    replicas = control_plane.kubectl("explain", "kvis.spec.replicas").stdout
    assert "0 to 1024. Default 1." in replicas


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_defaulted_as_the_offline_check_says(admin_api: Any, path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        stored = _dry_run_create(admin_api, doc["spec"], doc["metadata"]["name"])
        assert stored["spec"] == admit(doc)[0]["spec"]


@pytest.mark.parametrize(("spec", "message"), CEL_REJECTS, ids=[m for _, m in CEL_REJECTS])
def test_cel_rules_refuse_with_their_message(admin_api: Any, spec: dict[str, Any], message: str) -> None:
    assert message in _refusal(admin_api, {**MODEL, **spec})


@pytest.mark.parametrize(("spec", "offline"), SCHEMA_REJECTS, ids=[m for _, m in SCHEMA_REJECTS])
def test_the_schema_refuses_naming_the_field(admin_api: Any, spec: dict[str, Any], offline: str) -> None:
    assert _leaf(spec) in _refusal(admin_api, {**MODEL, **spec})


@pytest.mark.parametrize("spec", SOUND_SPECS)
def test_sound_specs_are_admitted(admin_api: Any, spec: dict[str, Any]) -> None:
    assert _dry_run_create(admin_api, {**MODEL, **spec})["metadata"]["name"] == "probe"
