"""kopf wiring, thin: kopf watches the InferenceServices and their children and keeps its watches
alive; every handler only puts a key on the work queue (runner.py), whose workers reconcile.

Only `on.event` handlers are registered, so kopf writes nothing on an InferenceService: no
finalizer (the garbage collector deletes the children, so deleting one never waits for the
operator, running or not) and no progress annotations (a restart changes no resourceVersion).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kopf

from .autoscale.scaling_spec import check_prometheus_address
from .controller import Controller
from .health import Health
from .key import Key
from .kube import Kube
from .manifests import GROUP, INSTANCE_LABEL, MANAGED_BY, PLURAL, VERSION
from .monitoring import EngineMonitoring
from .pilot import Pilots
from .reconcile import Extras
from .runner import Runner

# The children the operator writes, and the pods (whose engine failures become a condition): an
# event on any of them runs its owner again.
CHILDREN = (("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "secrets"),
            ("policy", "v1", "poddisruptionbudgets"), ("", "v1", "configmaps"),
            ("autoscaling", "v2", "horizontalpodautoscalers"), ("", "v1", "pods"))
MAX_API_RETRY_SECONDS = 10.0


@dataclass(frozen=True)
class OperatorConfig:
    image: str
    resync_interval: float = 300.0
    workers: int = 4
    health_port: int = 0  # 0: no probe endpoints
    monitoring: EngineMonitoring = EngineMonitoring()  # the PodMonitor per InferenceService
    prometheus_address: str | None = None  # KEDA's Prometheus when a spec names none
    engine_cache_host_path: str | None = None  # a node folder the engine pods' caches share

    def __post_init__(self) -> None:
        if self.resync_interval <= 0:
            raise ValueError(f"resync_interval: must be > 0, not {self.resync_interval}")
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1, not {self.workers}")
        if self.prometheus_address is not None:
            check_prometheus_address(self.prometheus_address)
        if self.engine_cache_host_path is not None and not self.engine_cache_host_path.startswith("/"):
            raise ValueError(f"engine_cache_host_path: must be an absolute path, not {self.engine_cache_host_path!r}")


class RetryForever:
    """kopf's API retry delays: 1, 2, 4, 8, then every 10 s, for ever. kopf gives up once an
    iterable ends (its default ends after ~54 s, and the operator exits); this one never ends and,
    unlike a generator, starts afresh for every request."""

    def __iter__(self) -> Iterator[float]:
        return (min(2.0 ** i, MAX_API_RETRY_SECONDS) for i in itertools.count())


def _owner_key(body: Any) -> Key | None:
    meta = body.get("metadata", {})
    name = (meta.get("labels") or {}).get(INSTANCE_LABEL)
    return Key(meta["namespace"], name) if name and meta.get("namespace") else None


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Attach the operator's handlers to `registry` (one registry per operator run)."""
    kopf.on.login(registry=registry)(kopf.login_via_client)

    @kopf.on.startup(registry=registry)
    async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        instance = os.environ.get("POD_NAME") or socket.gethostname()
        settings.networking.error_backoffs = RetryForever()
        settings.posting.reporting_component = "kvpilot"
        settings.posting.reporting_instance = instance
        settings.posting.level = logging.WARNING  # kopf's own warnings; ours are posted by the controller
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.connect_timeout = MAX_API_RETRY_SECONDS
        kube = Kube.from_environment()
        memo.kube = kube
        memo.pilots = Pilots(kube, instance, lambda key: memo.runner.add(key))
        extras = Extras(monitoring=config.monitoring, prometheus_address=config.prometheus_address,
                        engine_cache_host_path=config.engine_cache_host_path)
        controller = Controller(kube, config.image, instance, extras, memo.pilots)
        memo.runner = Runner(controller, config.workers, config.resync_interval)
        await memo.runner.start()
        memo.health = Health(kube.ping)
        if config.health_port:
            await memo.health.serve(config.health_port)

    @kopf.on.cleanup(registry=registry)
    async def stop(memo: kopf.Memo, **_: Any) -> None:
        if getattr(memo, "health", None) is not None:
            await memo.health.close()
        # the workers first: a reconcile (re)starts pilots, so they are closed once none runs
        if getattr(memo, "runner", None) is not None:
            await memo.runner.stop()
        if getattr(memo, "pilots", None) is not None:
            await memo.pilots.close()
        if getattr(memo, "kube", None) is not None:
            memo.kube.close()

    @kopf.on.event(GROUP, VERSION, PLURAL, id="queue", registry=registry)
    async def queue_inferenceservice(type: str, name: str, namespace: str | None, memo: kopf.Memo,
                                     **_: Any) -> None:
        if namespace:  # always: the resource is namespaced
            memo.runner.seen(Key(namespace, name), deleted=type == "DELETED")

    for group, version, plural in CHILDREN:
        @kopf.on.event(group, version, plural, labels={"app.kubernetes.io/managed-by": MANAGED_BY},
                       id="queue-owner", registry=registry)
        async def queue_owner(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
            if (key := _owner_key(body)) is not None:
                memo.runner.add(key)
