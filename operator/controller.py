"""One reconcile of one InferenceService, and the one place its errors become status, Events
and retry decisions.

The work queue hands a key to one worker at a time, so this is the only writer of an
InferenceService's status (a merge patch at the resourceVersion it read: a 409 means someone
else wrote first, and the key simply runs again on fresh data). Runs in a worker thread.

| outcome | status | Event | next |
| --- | --- | --- | --- |
| reconciled | computed from the children | Normal, one per child written | done |
| spec cannot work (SpecError, or a child the API server refuses) | Degraded InvalidSpec | Warning InvalidSpec | done; the next spec change runs again |
| 409 conflict | — | — | again soon |
| any other API error | Degraded ApiError once it persists | Warning ReconcileFailed | again after a backoff, for ever |
"""

from __future__ import annotations

import dataclasses
import logging
import time
from enum import Enum
from typing import TYPE_CHECKING

from . import metrics
from .events import build_event
from .key import Key
from .kube import ApiError, Kube
from .manifests import GROUP
from .model_source import SpecError
from .objects import Manifest
from .pilot_spec import measurement_basis
from .reconcile import Change, Desired, Extras, reconcile
from .status import api_error_status, invalid_spec_status, merge_conditions, status_changes
from .timestamps import now_iso

if TYPE_CHECKING:
    from kvpilot.runtime.tunables import LiveConfig

    from .pilot import Pilots, PilotSettings

logger = logging.getLogger(__name__)

# The finalizer operators before 0.2 put on every InferenceService; garbage collection does its
# work, so it is only ever removed (an object carrying it would wait for us to be deleted).
LEGACY_FINALIZER = f"{GROUP}/finalizer"
# An API error is reported (condition and Event) from this many failures in a row on; a 401/403
# at once, since waiting does not fix RBAC.
PERSISTENT_AFTER = 3



class Next(Enum):
    DONE = "success"
    GAVE_UP = "failed"  # the spec cannot work: nothing to retry until it changes
    AGAIN_SOON = "conflict"  # fresh data fixes it
    BACK_OFF = "retry"  # an API error: wait longer each time


class Controller:
    def __init__(self, kube: Kube, image: str, instance: str, extras: Extras | None = None,
                 pilots: Pilots | None = None) -> None:
        """`instance` names this operator replica in the Events it posts (its pod's name);
        `extras`: the operator's settings every reconcile takes; `pilots`: the services' pilot
        loops (autotune, autoscaling), whose views this, the one status writer, folds into status."""
        self.kube, self.image, self.instance = kube, image, instance
        self.extras, self.pilots = extras or Extras(), pilots

    def sync(self, key: Key, failures: int) -> Next:
        """Reconcile `key`; `failures` is how many attempts in a row failed before this one."""
        started = time.monotonic()
        try:
            result = self._sync(key, failures)
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        metrics.RECONCILES.labels(result=result.value).inc()
        return result

    def _sync(self, key: Key, failures: int) -> Next:
        body: Manifest | None = None
        try:
            body = self.kube.get("InferenceService", key.namespace, key.name)
            if body is None:  # deleted: the garbage collector removes the children
                self._pilot(key, None, {})
                return Next.DONE
            self._release_legacy_finalizer(body)
            if body["metadata"].get("deletionTimestamp"):
                self._pilot(key, None, {})
                return Next.DONE
            view = self.pilots.view(key) if self.pilots is not None else None
            extras = self.extras if view is None else dataclasses.replace(self.extras, tuned=view.tuned,
                                                                          tuned_by_pilot=True)
            try:
                outcome = reconcile(self.kube, body, self.image, now_iso(), extras)
            except SpecError as exc:
                self._pilot(key, None, {})
                return self._give_up(body, str(exc))
            except ApiError as exc:
                if not exc.invalid:
                    raise
                metrics.API_ERRORS.labels(status=str(exc.status)).inc()
                return self._give_up(body, f"the API server rejected a child object: {exc}")
            for change in outcome.changes:
                self._report_change(body, change)
            status = outcome.status
            if outcome.desired is not None:  # a loop turned off: its state goes (null deletes in a merge patch)
                scaling = outcome.desired.scaling
                off = {"tuning": not outcome.desired.tuning.enabled,
                       "scaling": not (scaling.enabled and scaling.mode == "builtin")}
                for stale in (k for k, gone in off.items() if gone and (body.get("status") or {}).get(k) is not None):
                    status = {**status, stale: None}
            if view is not None:
                generation = body["metadata"].get("generation", 0)
                status = {**status, **view.fields,
                          "conditions": merge_conditions(status["conditions"], list(view.conditions), generation,
                                                         now_iso())}
            self._write_status(body, status)
            if outcome.desired is not None:
                # what status holds after the write: a new pilot (an operator restart) starts from it
                self._pilot(key, self._pilot_settings(outcome.desired), {**(body.get("status") or {}), **status},
                            outcome.tuned)
            return Next.DONE
        except ApiError as exc:
            metrics.API_ERRORS.labels(status=str(exc.status)).inc()
            if exc.conflict:
                logger.info(f"InferenceService {key}: {exc}; again on fresh data")
                return Next.AGAIN_SOON
            logger.warning(f"InferenceService {key}: {exc}; retrying (failure {failures + 1} in a row)")
            if body is not None and (failures + 1 >= PERSISTENT_AFTER or exc.status in (401, 403)):
                self._report_api_error(body, exc)
            return Next.BACK_OFF

    def _pilot(self, key: Key, settings: PilotSettings | None, status: Manifest,
               tuned: LiveConfig | None = None) -> None:
        if self.pilots is not None:
            self.pilots.sync(key, settings, status, tuned)

    def _pilot_settings(self, desired: Desired) -> PilotSettings:
        from .autotune.engine_limits import EngineLimits
        from .pilot import PilotSettings

        engine = desired.spec.engine
        # Without chunked prefill a step must hold a whole prompt: the engine refuses a smaller
        # max_num_batched_tokens than max_model_len, which the spec may leave to the model.
        limits = EngineLimits(swap_space_gib=engine.swap_space, max_model_len=engine.max_model_len or 1,
                              enable_chunked_prefill=engine.enable_chunked_prefill)
        basis = measurement_basis(desired.spec, desired.spec.image or self.image)
        return PilotSettings(desired.owner, desired.tuning, desired.scaling, limits, self.instance, basis)

    def _release_legacy_finalizer(self, body: Manifest) -> None:
        finalizers = body["metadata"].get("finalizers") or []
        if LEGACY_FINALIZER in finalizers:
            meta = body["metadata"]
            kept = [f for f in finalizers if f != LEGACY_FINALIZER]
            body.update(self.kube.patch("InferenceService", meta["namespace"], meta["name"], [
                {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
                {"op": "replace", "path": "/metadata/finalizers", "value": kept}]))

    def post_event(self, body: Manifest, type_: str, reason: str, message: str) -> None:
        """Best effort: an Event lost to an outage is not worth a retry (the condition stays)."""
        try:
            self.kube.create(build_event(body, type_, reason, message, self.instance, now_iso()))
        except ApiError as exc:
            logger.warning(f"Event {reason} for InferenceService {body['metadata']['name']} not posted: {exc}")

    def _write_status(self, body: Manifest, status: Manifest) -> None:
        changes = status_changes(body.get("status") or {}, status)
        if changes:
            meta = body["metadata"]
            patch = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": changes}
            self.kube.patch("InferenceService", meta["namespace"], meta["name"], patch, subresource="status")

    def _report_change(self, body: Manifest, change: Change) -> None:
        metrics.CHILD_CHANGES.labels(kind=change.kind, action=change.action).inc()
        self.post_event(body, "Normal", change.action, change.message)

    def _give_up(self, body: Manifest, message: str) -> Next:
        """A spec that cannot work: said once, in Degraded and a Warning Event, until it changes."""
        current = body.get("status") or {}
        generation = body["metadata"].get("generation", 0)
        self._degrade(body, invalid_spec_status(current, generation, message, now_iso()), "InvalidSpec", message)
        return Next.GAVE_UP

    def _report_api_error(self, body: Manifest, exc: ApiError) -> None:
        message = f"cannot apply the spec, retrying: {exc}"
        current = body.get("status") or {}
        generation = body["metadata"].get("generation", 0)
        try:
            self._degrade(body, api_error_status(current, generation, message, now_iso()), "ReconcileFailed", message)
        except ApiError as status_error:  # the Event is still posted; the log has the rest
            logger.warning(f"status of InferenceService {body['metadata']['name']} not written: {status_error}")

    def _degrade(self, body: Manifest, status: Manifest, reason: str, message: str) -> None:
        before = _condition(body.get("status") or {}, "Degraded")
        after = _condition(status, "Degraded")
        if (before.get("reason"), before.get("message")) != (after.get("reason"), after.get("message")):
            self.post_event(body, "Warning", reason, message)
        self._write_status(body, status)


def _condition(status: Manifest, type_: str) -> Manifest:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})
