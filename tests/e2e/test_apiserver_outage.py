"""An API server outage of 120 s (`control-plane restart-apiserver DIR 120`), as a control-plane
upgrade causes: the operator stays up, reports itself unready meanwhile (/readyz; /healthz stays
up so it is never restarted for it), and catches up with what changed as the API server returns."""

from __future__ import annotations

import time
from pathlib import Path

from inference_services import children, create, new_namespace, reconciled
from kube_control_plane import ControlPlane, OperatorProcess, eventually

OUTAGE_SECONDS = 120


def test_a_120_s_outage_is_ridden_out_and_caught_up(control_plane: ControlPlane, cluster_wide_kubeconfig: Path,
                                                    tmp_path: Path) -> None:
    namespace = new_namespace(control_plane, "outage")
    operator = OperatorProcess(cluster_wide_kubeconfig, ["--all-namespaces", "--standalone"],
                               tmp_path / "operator.log").start()
    try:
        create(control_plane, namespace, "before")
        reconciled(control_plane, namespace, "before")

        restart = control_plane.restart_apiserver_in_background(OUTAGE_SECONDS)
        eventually(lambda: not operator.ready(), timeout=15, what="the operator to report itself unready")
        while restart.poll() is None:
            assert operator.alive and operator.ready() is False
            assert operator._get(operator.health_port, "/healthz")[0] == 200
            time.sleep(2)
        assert restart.returncode == 0, restart.stderr.read() if restart.stderr else ""

        # At once, before the operator's watches are back: what it must catch up on.
        control_plane.kubectl("patch", "kvis", "before", "-n", namespace, "--type=merge",
                              "-p", '{"spec": {"engine": {"blockSize": 32}}}')
        control_plane.kubectl("delete", "service", "before", "-n", namespace)
        create(control_plane, namespace, "after")

        eventually(operator.ready, timeout=30, what="the operator to be ready again")

        def carries_32() -> bool:
            args = control_plane.get("deployment", "before", namespace)["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[index]
            return bool(args[args.index("--block-size") + 1] == "32")
        eventually(carries_32, timeout=30, what="the spec edit rolled out")
        eventually(lambda: children(control_plane, namespace, "before"), timeout=30, what="the Service back")
        reconciled(control_plane, namespace, "after")
        assert operator.alive
    finally:
        operator.stop()
