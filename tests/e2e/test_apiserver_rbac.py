"""The chart's RBAC suffices, in both of its modes — cluster-wide (ClusterRole) and per namespace
(a Role in each watched namespace) — with and without the OwnerReferencesPermissionEnforcement
admission plugin: the operator, authenticated as the release's ServiceAccount, creates every child
(children carry blockOwnerDeletion) and writes status without one 403."""

from __future__ import annotations

from pathlib import Path

import pytest
from inference_services import CHILDREN, children, create, new_namespace, reconciled
from kube_control_plane import OWNER_REFERENCES_ENFORCEMENT, ControlPlane, OperatorProcess

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvpilot"
WATCHED = "team-a"  # the namespaced release's one namespace


@pytest.fixture(scope="module")
def namespaced_kubeconfig(control_plane: ControlPlane) -> Path:
    new_namespace(control_plane, WATCHED)
    control_plane.helm_install(CHART, "kvpilot-team-a", "kvpilot-team-a", {"watchNamespaces": [WATCHED]})
    return control_plane.service_account_kubeconfig("kvpilot-team-a", "kvpilot-team-a")


# Enforcing first: the session's control plane starts so, and it is restarted once, to plain.
@pytest.mark.parametrize(("admission", "mode"), [
    ("enforcing", "cluster-wide"), ("enforcing", "namespaced"), ("plain", "cluster-wide"), ("plain", "namespaced")])
def test_the_charts_rbac_suffices(control_plane: ControlPlane, cluster_wide_kubeconfig: Path,
                                  namespaced_kubeconfig: Path, tmp_path: Path, admission: str, mode: str) -> None:
    control_plane.ensure_apiserver_args(OWNER_REFERENCES_ENFORCEMENT if admission == "enforcing" else "")
    if mode == "cluster-wide":
        kubeconfig, args, namespace = cluster_wide_kubeconfig, ["--all-namespaces"], new_namespace(
            control_plane, f"rbac-{admission}")
    else:
        kubeconfig, args, namespace = namespaced_kubeconfig, [f"--namespace={WATCHED}"], WATCHED
    assert control_plane.kubectl("auth", "can-i", "update", "inferenceservices/finalizers", "-n", namespace,
                                 kubeconfig=kubeconfig).stdout.strip() == "yes"
    operator = OperatorProcess(kubeconfig, [*args, "--standalone"], tmp_path / "operator.log").start()
    try:
        name = f"{mode}-{admission}"
        create(control_plane, namespace, name)
        obj = reconciled(control_plane, namespace, name)
        assert {kind for kind, _ in CHILDREN} == set(children(control_plane, namespace, name) or {})
        assert {c["type"]: c["reason"] for c in obj["status"]["conditions"]}["Degraded"] == "AsExpected"
    finally:
        operator.stop()
    assert operator.log_lines("Forbidden") == []


def test_the_namespaced_release_may_not_touch_other_namespaces(control_plane: ControlPlane,
                                                              namespaced_kubeconfig: Path) -> None:
    """What the Roles leave out: the per-namespace mode is no cluster-wide mode in disguise."""
    for verb, resource in (("create", "deployments"), ("list", "secrets"), ("watch", "inferenceservices")):
        answer = control_plane.kubectl("auth", "can-i", verb, resource, "-n", "default",
                                       kubeconfig=namespaced_kubeconfig, check=False).stdout.strip()
        assert answer == "no", (verb, resource)
