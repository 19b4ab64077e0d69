"""The pilot: one asyncio task per InferenceService with autotune or autoscaling on, which every
interval scrapes each Ready pod (`autotune.ServiceScraper`) and acts on what it saw.

One pass: list the service's pods (ready: Ready with an IP, so scraped; starting; leaving), scrape
the ready ones, keep the pod-deletion-cost annotations current (every mode), take the scaling
step (`scaler.py`: the replicas in `mode: builtin`, the target's reach in every mode), then tune
(`tuner.py`) — in that order, and through one `Coordination` that each step takes and returns,
so a pass never changes both and a scale event pauses tuning for a dwell. A step is a function of
its inputs that returns its new state and what to do (a scale write, Events, decision records);
the pilot does it, and keeps the new state once it is done.

The pilot never writes status: it publishes a `PilotView` (conditions, `status.tuning`,
`status.scaling`, `status.decisions`, `status.metrics`, the tuned config) and puts the service's
key on the work queue; the reconcile that follows folds the view into the status it writes
(`controller.py`, the one status writer), and writes the tuned config into the ConfigMap or the
Deployment's flags. It writes only what is its own: the replicas through the scale subresource,
the pods' deletion-cost annotations, and Events.

Pods are reached directly at their IP on the serving port (never through the API server's
pods/proxy): the engine's `/metrics` and `/admin/config` (Bearer token from the service's admin
Secret). The pods run the engine, not the operator, so the chart's NetworkPolicy (which covers
only the operator's own pods) does not stand in the way; a policy that isolates the engine pods
must admit the operator's pods on port 8000.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

import aiohttp

from kvpilot.runtime.tunables import LiveConfig

from . import metrics
from .autoscale.calculator import PodState
from .autoscale.coordination import Coordination
from .autoscale.deletion_cost import DELETION_COST_ANNOTATION, cost_patch, deletion_costs
from .autoscale.history import DecisionRecord, appended
from .autoscale.scaling_spec import ScalingSpec
from .autoscale.startup import PodStartup, pod_startup
from .autotune.admin import AdminClient
from .autotune.endpoint import PodEndpoint
from .autotune.engine_limits import EngineLimits
from .autotune.scrape import ScrapeReport, ServiceScraper
from .autotune.tuning_spec import TuningSpec
from .engine_args import SERVE_PORT
from .events import build_event
from .key import Key
from .kube import ApiError, Kube
from .manifests import ADMIN_TOKEN_KEY, Owner, selector_string
from .objects import Manifest
from .scaler import ScalingInputs, ScalingState, scale, watch_target
from .timestamps import now_iso
from .tuner import TuningInputs, tune
from .tuner_state import TunerState

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0
IDLE_INTERVAL_S = 15.0  # deletion costs alone (modes hpa and keda): as often as an HPA syncs
POD_TEMPLATE_LABEL = "pod-template-hash"  # set by the Deployment controller on each ReplicaSet's pods


@dataclass(frozen=True)
class PilotSettings:
    """What a pilot acts on, from the InferenceService's spec; a new value restarts nothing."""

    owner: Owner
    tuning: TuningSpec
    scaling: ScalingSpec
    limits: EngineLimits
    instance: str  # this operator replica, in the Events it posts
    basis: tuple[tuple[str, str], ...] = ()  # what measured outcomes hold for (pilot_spec.measurement_basis)

    @property
    def active(self) -> bool:
        return self.tuning.enabled or self.scaling.enabled

    @property
    def interval_s(self) -> float:
        intervals = [self.tuning.interval_s] if self.tuning.enabled else []
        if self.scaling.enabled and self.scaling.mode == "builtin":
            intervals.append(self.scaling.interval)
        return min(intervals, default=IDLE_INTERVAL_S)

    @property
    def span_s(self) -> float:
        spans = [self.tuning.window_span_s] if self.tuning.enabled else []
        if self.scaling.enabled:
            spans.append(self.scaling.window + self.scaling.interval)
        return max(spans, default=IDLE_INTERVAL_S)

    @property
    def dwell_s(self) -> float:
        """How long a scale event pauses tuning, and a tuning change holds scale-downs."""
        return max(self.tuning.min_dwell_s if self.tuning.enabled else 0.0, self.scaling.window)


@dataclass(frozen=True)
class PilotView:
    """What the reconcile folds into status: the pilot's conditions and fields."""

    tuned: LiveConfig | None = None
    conditions: tuple[Manifest, ...] = ()
    fields: Manifest = field(default_factory=dict)


@dataclass(frozen=True)
class Pods:
    states: dict[str, PodState]
    endpoints: list[PodEndpoint]
    deletion_costs: dict[str, str | None]  # the annotation as it stands, by pod
    # the pod templates (the Deployment's pod-template-hash labels) of every pod, whatever its
    # state: more than one while a rollout replaces the pods of one spec with another's
    templates: frozenset[str] = frozenset()
    startups: tuple[PodStartup, ...] = ()  # the Ready pods' creation to Ready


def classify(pods: list[Manifest]) -> Pods:
    """ready: Ready with an IP (in the Service's endpoints, so scraped); leaving: being deleted
    or finished; starting: the rest (scheduled, pulling, loading the model)."""
    states: dict[str, PodState] = {}
    endpoints, costs, templates = [], {}, set()
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {}) or {}
        name = meta["name"]
        costs[name] = (meta.get("annotations") or {}).get(DELETION_COST_ANNOTATION)
        template = (meta.get("labels") or {}).get(POD_TEMPLATE_LABEL)
        if template:
            templates.add(template)
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if meta.get("deletionTimestamp") or status.get("phase") in ("Failed", "Succeeded"):
            states[name] = "leaving"
        elif ready and status.get("podIP"):
            states[name] = "ready"
            endpoints.append(PodEndpoint(name, status["podIP"], _serving_port(pod)))
        else:
            states[name] = "starting"
    startups = tuple(startup for pod in pods if (startup := pod_startup(pod)) is not None)
    return Pods(states, sorted(endpoints, key=lambda e: e.pod), costs, frozenset(templates), startups)


def _serving_port(pod: Manifest) -> int:
    for container in pod.get("spec", {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return SERVE_PORT


class Pilot:
    """One InferenceService's loop; `settings` may be replaced between passes."""

    def __init__(self, key: Key, kube: Kube, session: aiohttp.ClientSession, settings: PilotSettings,
                 status: Manifest, tuned: LiveConfig | None, poke: Callable[[Key], None],
                 clock: Callable[[], float] = time.time) -> None:
        """`status`: the service's status as an earlier pilot left it; `tuned`: the tuned config
        it left (`reconcile.recorded_tuned`), which the view carries until this pilot has its own."""
        self.key, self.kube, self.session, self.poke, self.clock = key, kube, session, poke, clock
        self.settings = settings
        self.scraper = ServiceScraper(key.namespace, key.name, session, timeout_s=SCRAPE_TIMEOUT_S,
                                      span_s=settings.span_s, clock=clock)
        self.decisions: list[Manifest] = list(status.get("decisions") or [])
        self.tuning = TunerState.from_status(status.get("tuning") or {}, tuned)
        # a canary an earlier operator left is still being judged: no scale-down meanwhile
        self.coordination = Coordination(tuning_in_flight=self.tuning.canary is not None)
        self.scaling = ScalingState.from_status(status.get("scaling") or {})
        self.metrics: Manifest | None = status.get("metrics")
        self.view = PilotView(tuned)
        self.body: Manifest = {}
        self._token: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()

    def update(self, settings: PilotSettings) -> None:
        if settings != self.settings:
            self.settings = settings
            self.scraper.span_s = settings.span_s
            for window in self.scraper.windows.values():
                window.span_s = settings.span_s
            self._wakeup.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kvpilot pilot {self.key}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # waits for it to end without taking its CancelledError for one of the caller's own
            await asyncio.wait([self._task])
        self.scraper.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except ApiError as exc:  # the API server is away: the next pass tries again
                logger.warning(f"pilot of InferenceService {self.key}: {exc}")
            except Exception:  # a bug must not end the loop of every later pass
                logger.exception(f"pilot of InferenceService {self.key} failed")
            self._wakeup.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the wake-up and drops a
            # cancellation (Pilot.stop's) that arrives as the event is set, and the loop would go on
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.interval_s):
                    await self._wakeup.wait()

    async def run_once(self) -> None:
        key = self.key
        body = await asyncio.to_thread(self.kube.get, "InferenceService", key.namespace, key.name)
        if body is None:
            return
        self.body = body
        items = await asyncio.to_thread(self.kube.list_objects, "Pod", key.namespace, selector_string(self.settings.owner))
        pods = classify(items)
        report = await self.scraper.scrape(pods.endpoints)
        now = self.clock()
        self.metrics = _service_metrics(report, self.scraper, now, self.settings.interval_s) or self.metrics
        if self.settings.scaling.enabled:
            await self._scale(now, pods)
        if self.settings.tuning.enabled:
            await self._tune(now, pods, report)
        self._publish()

    async def _scale(self, now: float, pods: Pods) -> None:
        """Deletion costs, then the scaling step, and what it asks for."""
        spec, key = self.settings.scaling, self.key
        summaries = self.scraper.summaries(since=now - spec.window)
        for pod, cost in deletion_costs(summaries, pods.deletion_costs).items():
            try:
                await asyncio.to_thread(self.kube.patch, "Pod", key.namespace, pod, cost_patch(cost))
            except ApiError as exc:  # the pod went away meanwhile, most likely: the next pass tells
                logger.info(f"deletion cost of pod {pod} not written: {exc}")
        inputs = ScalingInputs(now, spec, int(self.body.get("spec", {}).get("replicas", 1)), summaries,
                               pods.states, self.coordination, self.settings.dwell_s,
                               self.scraper.summaries(since=now - self.settings.interval_s), pods.startups)
        step = scale(self.scaling, inputs) if spec.mode == "builtin" else watch_target(self.scaling, inputs)
        if step.scale_to is not None and step.direction is not None:  # an API error keeps the state we had
            await asyncio.to_thread(self.kube.patch, "InferenceService", key.namespace, key.name,
                                    {"spec": {"replicas": step.scale_to}}, "scale")
            self.body.setdefault("spec", {})["replicas"] = step.scale_to
            metrics.SCALING_DECISIONS.labels(key.namespace, key.name, step.direction).inc()
        self.scaling, self.coordination = step.state, step.coordination
        if spec.mode == "builtin" and step.state.desired is not None:
            metrics.DESIRED_REPLICAS.labels(key.namespace, key.name).set(step.state.desired)
        for record in step.records:
            self.record(record)
        for event in step.events:
            await self.post_event(event.type, event.reason, event.message)

    async def _tune(self, now: float, pods: Pods, report: ScrapeReport) -> None:
        """The tuning step, its admin calls to the pods, and what it asks for."""
        settings, key = self.settings, self.key
        endpoints = {e.pod: e for e in pods.endpoints if e.pod in report.samples}
        inputs = TuningInputs(now, settings.tuning, settings.limits, dict(settings.basis), self.scraper.windows,
                              {p: s.settings for p, s in report.samples.items()}, endpoints, self.coordination,
                              settings.dwell_s, len(pods.templates), len(report.failures))
        admin = AdminClient(self.session, await self.admin_token(), timeout_s=10, attempts=3,
                            backoff_s=0.2) if endpoints else None
        step = await tune(self.tuning, inputs, admin)
        self.tuning, self.coordination = step.state, step.coordination
        if step.outcome is not None:
            metrics.TUNING_DECISIONS.labels(key.namespace, key.name, step.outcome).inc()
            if step.outcome == "rolled_back":
                metrics.TUNING_ROLLBACKS.labels(key.namespace, key.name).inc()
        for record in step.records:
            self.record(record)
        for event in step.events:
            await self.post_event(event.type, event.reason, event.message)

    def record(self, record: DecisionRecord) -> None:
        self.decisions = appended(self.decisions, record)

    async def post_event(self, type_: str, reason: str, message: str) -> None:
        if not self.body:
            return
        event = build_event(self.body, type_, reason, message, self.settings.instance, now_iso())
        try:
            await asyncio.to_thread(self.kube.create, event)
        except ApiError as exc:
            logger.warning(f"Event {reason} for InferenceService {self.key} not posted: {exc}")

    async def admin_token(self) -> str:
        if self._token is None:
            secret = await asyncio.to_thread(self.kube.get, "Secret", self.key.namespace,
                                             self.settings.owner.admin_secret_name)
            encoded = ((secret or {}).get("data") or {}).get(ADMIN_TOKEN_KEY)
            if not encoded:
                raise ApiError(404, "NotFound", f"Secret {self.settings.owner.admin_secret_name} has no {ADMIN_TOKEN_KEY}")
            self._token = base64.b64decode(encoded).decode()
        return self._token

    def _publish(self) -> None:
        tuning = self.settings.tuning.enabled
        builtin = self.settings.scaling.enabled and self.settings.scaling.mode == "builtin"
        conditions = tuple(c for c in (self.tuning.condition if tuning else None,
                                       self.scaling.condition if builtin else None) if c is not None)
        fields: Manifest = {"decisions": self.decisions}
        if tuning:
            fields["tuning"] = self.tuning.to_status()
        if builtin:
            fields["scaling"] = self.scaling.to_status()
        if self.metrics is not None:
            fields["metrics"] = self.metrics
        view = PilotView(self.tuning.tuned, conditions, fields)
        if view != self.view:
            self.view = view
            self.poke(self.key)


def _service_metrics(report: ScrapeReport, scraper: ServiceScraper, now: float, interval_s: float) -> Manifest | None:
    """status.metrics: the last scrape's gauges and the last intervals' preemption rate, means over pods."""
    samples = list(report.samples.values())
    if not samples:
        return None
    recent = scraper.summaries(since=now - 2 * interval_s)
    return {
        "scrapedAt": now_iso(),
        "kvCacheUsage": round(fmean(s.gauges["kv_cache_usage"] for s in samples), 4),
        "numRequestsRunning": round(fmean(s.gauges["num_running_seqs"] for s in samples), 2),
        "numRequestsWaiting": round(fmean(s.gauges["num_waiting_seqs"] for s in samples), 2),
        "preemptionsPerSecond": round(fmean(s.preemptions_per_s for s in recent.values()), 4) if recent else 0.0,
    }


class Pilots:
    """Every service's pilot, on the operator's event loop. The controller calls `sync` from its
    worker threads after each reconcile; `view` is read from them too (an attribute read)."""

    def __init__(self, kube: Kube, instance: str, poke: Callable[[Key], None]) -> None:
        self.kube, self.instance, self.poke = kube, instance, poke
        self.loop = asyncio.get_running_loop()
        self.session = aiohttp.ClientSession()
        self.pilots: dict[Key, Pilot] = {}
        self.closed = False  # a reconcile still in its thread at shutdown starts no pilot after close

    def view(self, key: Key) -> PilotView | None:
        pilot = self.pilots.get(key)
        return pilot.view if pilot is not None else None

    def sync(self, key: Key, settings: PilotSettings | None, status: Mapping[str, Any],
             tuned: LiveConfig | None = None) -> None:
        """Start, update or stop `key`'s pilot (None: the service is gone or needs none); a new
        pilot starts from `status` and `tuned` (see `Pilot`). Thread-safe."""
        self.loop.call_soon_threadsafe(self._sync, key, settings, dict(status), tuned)

    def _sync(self, key: Key, settings: PilotSettings | None, status: Manifest, tuned: LiveConfig | None) -> None:
        if self.closed:
            return
        pilot = self.pilots.get(key)
        if settings is None or not settings.active:
            if pilot is not None:
                del self.pilots[key]
                asyncio.ensure_future(pilot.stop())
            return
        if pilot is None:
            pilot = self.pilots[key] = Pilot(key, self.kube, self.session, settings, status, tuned, self.poke)
            pilot.start()
        else:
            pilot.update(settings)

    async def close(self) -> None:
        self.closed = True
        for pilot in list(self.pilots.values()):
            await pilot.stop()
        self.pilots.clear()
        await self.session.close()
