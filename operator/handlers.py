"""kopf handlers: thin. They parse, call the reconciler, and turn its outcome into status,
Events, metrics and kopf's retry (`TemporaryError`) or give-up (`PermanentError`) signals.

Handlers are synchronous on purpose: kopf runs them in worker threads, so the blocking client
never stalls kopf's event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import kopf

from . import metrics
from .kube import ApiError, Kube
from .manifests import GROUP, INSTANCE_LABEL, MANAGED_BY, PLURAL, VERSION, Owner
from .model_source import SpecError
from .reconcile import Change, cleanup, observed_status, reconcile
from .status import invalid_spec_status, now_iso, status_changes

MAX_BACKOFF_SECONDS = 60.0
STATUS_WRITE_ATTEMPTS = 3
CONFLICT_DELAY_SECONDS = 0.5


@dataclass(frozen=True)
class OperatorConfig:
    image: str
    resync_interval: float = 300.0


def backoff(retry: int) -> float:
    """1, 2, 4, ... seconds, capped: kopf's `retry` counts the attempts so far."""
    return min(2.0 ** retry, MAX_BACKOFF_SECONDS)


def _as_dict(body: Any) -> dict[str, Any]:
    return {key: body[key] for key in body}


def write_status(kube: Kube, body: dict[str, Any], status: dict[str, Any]) -> None:
    """Patch what changed, at the resourceVersion `status` was computed from: two writers (the
    reconcile and the Deployment watcher) must not let an older view overwrite a newer one, so
    a write over a changed object fails with 409 and is recomputed."""
    changes = status_changes(body.get("status") or {}, status)
    if not changes:
        return
    meta = body["metadata"]
    patch = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": changes}
    kube.patch("InferenceService", meta["namespace"], meta["name"], patch, subresource="status")


def _report(body: Any, changes: list[Change]) -> None:
    for change in changes:
        metrics.CHILD_CHANGES.labels(kind=change.kind, action=change.action).inc()
        kopf.event(body, type="Normal", reason=change.action, message=change.message)


@contextmanager
def _reconcile_errors(body: Any, patch: kopf.Patch, retry: int) -> Iterator[None]:
    """The one place where errors become status, Events and kopf's retry decisions."""
    started = time.monotonic()
    try:
        yield
    except SpecError as exc:
        _give_up(body, patch, str(exc))
    except ApiError as exc:
        metrics.API_ERRORS.labels(status=str(exc.status)).inc()
        if exc.invalid:
            _give_up(body, patch, f"the API server rejected a child object: {exc}")
        metrics.RECONCILES.labels(result="retry").inc()
        if exc.conflict:  # someone wrote first: retry soon, on fresh data
            raise kopf.TemporaryError(f"conflict, retrying: {exc}", delay=CONFLICT_DELAY_SECONDS) from exc
        raise kopf.TemporaryError(f"API error, retrying: {exc}", delay=backoff(retry)) from exc
    else:
        metrics.RECONCILES.labels(result="success").inc()
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


def _give_up(body: Any, patch: kopf.Patch, message: str) -> None:
    metrics.RECONCILES.labels(result="failed").inc()
    current = dict(body.get("status") or {})
    generation = body.get("metadata", {}).get("generation", 0)
    patch.status.update(status_changes(current, invalid_spec_status(current, generation, message, now_iso())))
    kopf.event(body, type="Warning", reason="InvalidSpec", message=message)
    raise kopf.PermanentError(message)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Attach the operator's handlers to `registry` (one registry per operator run)."""
    resource = (GROUP, VERSION, PLURAL)

    kopf.on.login(registry=registry)(kopf.login_via_client)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        # Keep kopf's bookkeeping under our own prefix; status stays the CRD's schema.
        settings.persistence.finalizer = f"{GROUP}/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        # Our Events are explicit (kopf.event); only kopf's own warnings become Events too.
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        memo.kube = Kube.from_environment()

    @kopf.on.cleanup(registry=registry)
    def close(memo: kopf.Memo, **_: Any) -> None:
        if getattr(memo, "kube", None) is not None:
            memo.kube.close()

    def _reconcile(body: Any, patch: kopf.Patch, memo: kopf.Memo, retry: int) -> None:
        with _reconcile_errors(body, patch, retry):
            raw = _as_dict(body)
            outcome = reconcile(memo.kube, raw, config.image, now_iso())
            _report(body, outcome.changes)
            write_status(memo.kube, raw, outcome.status)

    @kopf.on.resume(*resource, id="reconcile", registry=registry)
    @kopf.on.create(*resource, id="reconcile", registry=registry)
    @kopf.on.update(*resource, id="reconcile", registry=registry)
    def reconcile_inferenceservice(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, retry: int,
                                   **_: Any) -> None:
        _reconcile(body, patch, memo, retry)

    @kopf.timer(*resource, id="resync", interval=config.resync_interval,
                initial_delay=config.resync_interval, registry=registry)
    def resync_inferenceservice(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo,
                                **kwargs: Any) -> None:
        """Repairs drift nobody announced (a child deleted or edited by hand)."""
        _reconcile(body, patch, memo, int(kwargs.get("retry", 0)))

    @kopf.on.delete(*resource, id="cleanup", registry=registry)
    def delete_children(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
        try:
            changes = cleanup(memo.kube, Owner.from_body(body))
        except ApiError as exc:
            metrics.API_ERRORS.labels(status=str(exc.status)).inc()
            raise kopf.TemporaryError(f"cleanup failed, retrying: {exc}", delay=backoff(retry)) from exc
        _report(body, changes)

    @kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGED_BY},
                   id="deployment-status", registry=registry)
    def reflect_deployment_status(body: kopf.Body, type: str | None, memo: kopf.Memo,
                                  logger: kopf.Logger, **_: Any) -> None:
        """Ready replicas and rollout progress, as soon as the Deployment controller reports them."""
        name = body.get("metadata", {}).get("labels", {}).get(INSTANCE_LABEL)
        namespace = body.get("metadata", {}).get("namespace")
        if not name or not namespace or type is None:  # type None: the initial listing; resume covers it
            return
        deployment = None if type == "DELETED" else _as_dict(body)
        for _attempt in range(STATUS_WRITE_ATTEMPTS):
            try:
                owner = memo.kube.get("InferenceService", namespace, name)
                if owner is None or owner["metadata"].get("deletionTimestamp"):
                    return
                write_status(memo.kube, owner, observed_status(owner, deployment, now_iso()))
                return
            except ApiError as exc:
                if not exc.conflict:  # the IS's own handlers and the resync timer catch up
                    logger.warning(f"status of InferenceService {namespace}/{name} not refreshed: {exc}")
                    return
            except SpecError:
                return
