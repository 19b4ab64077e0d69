"""One real control plane for the whole session (tests/support/kube_control_plane.py), started
with the OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift): the strictest
RBAC the operator meets. The CRDs are installed both ways a user installs them — `kubectl apply
-f crds/`, then (after deleting them) `helm install` of the chart, whose ServiceAccount and RBAC
the operator then runs with."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_control_plane import OWNER_REFERENCES_ENFORCEMENT, ControlPlane, missing

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpilot"
CRD_NAME = "inferenceservices.serving.kvpilot.io"
RELEASE, RELEASE_NAMESPACE = "kvpilot", "kvpilot-system"  # the chart's defaults: every namespace


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if (reason := missing()) is not None:
        pytest.skip(f"no real Kubernetes control plane: {reason}")
    plane = ControlPlane(Path(os.environ["KVPILOT_KUBE_ASSETS"]).resolve(), tmp_path_factory.mktemp("k8s"))
    plane.start(OWNER_REFERENCES_ENFORCEMENT)
    try:
        plane.kubectl("apply", "-f", str(ROOT / "crds"))
        plane.wait_for_condition("crd", CRD_NAME, "Established")
        plane.kubectl("delete", "-f", str(ROOT / "crds"), "--wait=true", "--timeout=60s")
        plane.helm_install(CHART, RELEASE, RELEASE_NAMESPACE, {})
        plane.wait_for_condition("crd", CRD_NAME, "Established")
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def admin_api(control_plane: ControlPlane) -> Any:
    """The official client as the cluster's admin, for what kubectl would be slow at."""
    import kubernetes

    return kubernetes.config.new_client_from_config(config_file=str(control_plane.kubeconfig))


@pytest.fixture(scope="session")
def cluster_wide_kubeconfig(control_plane: ControlPlane) -> Path:
    """Authenticates as the chart's ServiceAccount of the cluster-wide release."""
    return control_plane.service_account_kubeconfig(RELEASE_NAMESPACE, RELEASE)
