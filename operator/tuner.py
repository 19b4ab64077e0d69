"""The autotuner's step in a pilot pass: converge, judge a canary, or decide — as two functions
of explicit inputs and one runner, so the operator's pilot and `kvpilot bench autotune` take the
same step (only the pods and the clock differ).

* `plan(state, inputs)`: what this pass does, and the admin calls it needs (`Change`s: bring a
  pod to a config with `POST /admin/config`; or a read of one pod's config).
* `execute(plan, admin, endpoints)`: those calls, one at a time; each answer or refusal is a
  `ChangeResult`.
* `settle(plan, results, inputs)`: the new state, with the Events, decision records and the
  decision metric's outcome for the caller to post, record and count.
`tune` runs the three.

One action a pass:
* *read*: the config in force is not known yet (a new service): one pod is asked for it
  (`GET /admin/config`; a reloaded canary's pod runs the target, so another is asked, and the
  config the canary left, when status kept it, needs no asking);
* *converge*: a Ready pod that reports other tuned knobs (block size, preemption mode, batch
  limits: `autotune.Knobs`) than the config in force (restarted before its ConfigMap was current,
  or added by a scale-up) is brought to it, the others untouched;
* *judge*: a change being tried on a canary pod is judged (`autotune.judge`) until it is
  promoted to every other pod or rolled back; a canary pod that went away ends it (lost);
* *decide*: the policy (`autotune.decide`) asks for a change, which goes to the least loaded pod
  as a canary (`apply: live`), or becomes the config in force at once (`apply: rollout`: the
  reconcile writes it into the Deployment's flags, which rolls the pods).
A pod that refuses the admin call leaves the service on its previous config: the canary is not
started (or is rolled back), Tuned turns False with reason AdminCallFailed, and the cooldown
applies before the next try.

*Memory*: what each configuration measured at capacity and what each switch paused the engine
for (`autotune.Outcomes`) are kept in the state, and so in status.tuning; a spec whose model,
image, GPUs, placement or engine flags changed drops them (Event TuningOutcomesReset). Nothing is
measured while pods of two pod templates run (a rollout of another spec under way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from kvpilot.runtime.tunables import LiveConfig

from .autoscale.coordination import Coordination
from .autoscale.history import DecisionRecord, tune_record
from .autotune.admin import AdminClient, AdminError
from .autotune.canary import judge
from .autotune.endpoint import PodEndpoint
from .autotune.engine_limits import EngineLimits
from .autotune.policy import Decision, decide
from .autotune.sample import EngineSettings
from .autotune.tuning_spec import Knobs, TuningSpec
from .autotune.window import MetricWindow, WindowSummary
from .events import Event
from .status import condition
from .tuner_state import Canary, TunerState, short

Action = Literal["wait", "read", "converge", "canary", "rollout", "promote", "roll_back", "lost"]
# kvpilot_operator_tuning_decisions_total's outcome label
Outcome = Literal["canary", "promoted", "rolled_back", "applied", "skipped"]


@dataclass(frozen=True)
class TuningInputs:
    now: float
    spec: TuningSpec
    limits: EngineLimits
    basis: Mapping[str, str]  # what measured outcomes hold for (pilot_spec.measurement_basis)
    windows: Mapping[str, MetricWindow]  # each scraped pod's window
    reported: Mapping[str, EngineSettings]  # this pass's scrape: the settings each Ready pod reports
    endpoints: Mapping[str, PodEndpoint]  # the Ready pods scraped this pass
    coordination: Coordination
    dwell_s: float  # how long a scale event pauses tuning
    num_templates: int = 1  # pod templates serving: more than one while a rollout replaces the pods
    num_failures: int = 0  # pods that could not be scraped this pass

    def summaries(self, since: float | None = None, until: float | None = None) -> dict[str, WindowSummary]:
        out = {pod: w.summarize(since, until) for pod, w in self.windows.items()}
        return {pod: s for pod, s in out.items() if s is not None}


@dataclass(frozen=True)
class Change:
    """An admin call: bring `pod` to `target` (`None`: only read its config)."""

    pod: str
    target: LiveConfig | None


@dataclass(frozen=True)
class ChangeResult:
    pod: str
    config: LiveConfig | None  # what the pod runs after the call; None: it failed
    error: str = ""
    before: LiveConfig | None = None  # what it ran before a change
    duration_s: float = 0.0  # how long the engine took to apply it (its own account)
    pause_s: float | None = None  # a block-size change: the engine's own pause (relayout.pause_ms)


@dataclass(frozen=True)
class Plan:
    state: TunerState  # after this pass's bookkeeping (pods reported, outcomes observed)
    action: Action
    changes: tuple[Change, ...] = ()
    decision: Decision | None = None
    reason: str = ""  # a verdict's reason (promote, roll_back)
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class TuningStep:
    state: TunerState
    coordination: Coordination
    events: tuple[Event, ...] = ()
    records: tuple[DecisionRecord, ...] = ()
    outcome: Outcome | None = None
    action: Action = "wait"
    calls: tuple[ChangeResult, ...] = ()  # the admin calls the pass made, with their answers


def _tuned(status: bool | None, reason: str, message: str) -> dict[str, str]:
    return condition("Tuned", status, reason, message)


def plan(state: TunerState, inputs: TuningInputs) -> Plan:
    spec, now = inputs.spec, inputs.now
    outcomes, events = state.outcomes.copy(), []
    observed = state.observed
    if changed := outcomes.rebase(dict(inputs.basis)):
        observed = None  # windows scraped so far ran under the old basis
        events.append(Event("Normal", "TuningOutcomesReset", "measured outcomes and switch pauses dropped, they "
                                                             f"were measured under another spec: {'; '.join(changed)}"))
    # while a rollout runs pods of two specs, their windows are no configuration's capacity
    if observed is not None and inputs.num_templates <= 1:
        outcomes.observe(inputs.summaries(since=observed), spec.thresholds, last_change=state.last_change)
    pods = {p: s.knobs for p, s in inputs.reported.items()}
    state = replace(state, outcomes=outcomes, observed=now, pods=pods)
    endpoints = inputs.endpoints
    if not endpoints:
        message = f"no Ready pod could be scraped ({inputs.num_failures} failed)"
        return Plan(replace(state, condition=_tuned(None, "AwaitingMetrics", message)), "wait", events=tuple(events))
    if state.config is None and state.canary is not None and state.canary.previous is not None:
        # reloaded before any change was promoted: the config in force is the one the canary left,
        # which a pod read could not tell when the canary pod is the only one
        state = replace(state, config=state.canary.previous)
    if state.config is None:
        others = [p for p in endpoints if state.canary is None or p != state.canary.pod]
        return Plan(state, "read", (Change(min(others or endpoints), None),), events=tuple(events))
    if state.canary is not None and state.canary.previous is None:  # reloaded from a status without it
        state = replace(state, canary=replace(state.canary, previous=state.config))
    if spec.apply == "live" and state.canary is not None:
        return replace(_judge(state, inputs), events=tuple(events))
    config = state.config
    assert config is not None  # read above
    drift = [Change(p, config) for p, k in sorted(pods.items()) if p in endpoints and k != Knobs.of(config)]
    if spec.apply == "live" and drift:
        return Plan(state, "converge", tuple(drift), events=tuple(events))
    return replace(_decide(state, inputs), events=tuple(events))


def _decide(state: TunerState, inputs: TuningInputs) -> Plan:
    spec, now, config = inputs.spec, inputs.now, state.config
    assert config is not None
    turn = inputs.coordination.may_tune(now, inputs.dwell_s)
    if not turn.allowed:
        held = True if state.condition is None else state.condition["status"] == "True"
        return Plan(replace(state, condition=_tuned(held, "WaitingForScaling", turn.reason)), "wait")
    last = max((t for t in (state.last_change, state.attempted) if t is not None), default=None)
    decision = decide(inputs.summaries(since=now - spec.min_dwell_s), config, spec, inputs.limits, now=now,
                      last_change=last, measured=state.outcomes.measured(spec.canary.window_s),
                      pauses=state.outcomes.pauses())
    if decision.target is None:
        waiting = decision.signals is None
        if state.condition is None or state.condition["reason"] in ("AwaitingMetrics", "ConfigHolds") \
                or not waiting:
            first = waiting and state.last_change is None
            state = replace(state, condition=_tuned(None if first else True,
                                                    "AwaitingMetrics" if first else "ConfigHolds", decision.reason))
        return Plan(state, "wait", decision=decision)
    if spec.apply == "rollout":
        return Plan(state, "rollout", decision=decision)
    pod = min(inputs.endpoints, key=lambda p: (_load(inputs.windows.get(p)), p))
    return Plan(state, "canary", (Change(pod, decision.target),), decision=decision)


def _load(window: MetricWindow | None) -> float:
    sample = window.latest if window is not None else None
    return 0.0 if sample is None else sample.gauges["num_running_seqs"] + sample.gauges["num_waiting_seqs"]


def _judge(state: TunerState, inputs: TuningInputs) -> Plan:
    spec, canary, endpoints = inputs.spec, state.canary, inputs.endpoints
    assert canary is not None and canary.previous is not None
    if canary.pod not in endpoints:
        return Plan(state, "lost")
    since = inputs.summaries(since=canary.since)
    baseline = [s for p, s in since.items() if p != canary.pod]
    rollback = (Change(canary.pod, canary.previous),)
    if not baseline and canary.reloaded and not set(endpoints) - {canary.pod}:
        # alone, a canary is judged against its own window before the change, which went with
        # the operator that started it: nothing fair is left to judge it on
        return Plan(state, "roll_back", rollback, reason="the operator restarted during the canary and the window "
                                                         "before the change, which a lone canary is judged "
                                                         "against, was lost")
    if not baseline and (window := inputs.windows.get(canary.pod)) is not None:
        before = window.summarize(since=canary.since - spec.canary.window_s, until=canary.since)
        baseline = [before] if before is not None else []
    verdict = judge(since.get(canary.pod), baseline, canary.target, spec, elapsed_s=inputs.now - canary.since)
    if verdict.verdict == "promote":
        others = tuple(Change(p, canary.target) for p in sorted(endpoints) if p != canary.pod)
        return Plan(state, "promote", others, reason=verdict.reason)
    if verdict.verdict == "rollback":
        return Plan(state, "roll_back", rollback, reason=verdict.reason)
    message = f"pod {canary.pod} tries {short(canary.target)}: {verdict.reason}"
    return Plan(replace(state, condition=_tuned(None, "CanaryInProgress", message)), "wait")


async def execute(plan: Plan, admin: AdminClient | None, endpoints: Mapping[str, PodEndpoint]) -> list[ChangeResult]:
    """The plan's admin calls, one pod at a time; a refusal or an unreachable pod is a result too."""
    results = []
    for change in plan.changes:
        if admin is None:
            raise ValueError("admin: the plan calls pods, an admin client is needed")
        endpoint = endpoints[change.pod]
        try:
            current = await admin.get_config(endpoint)
            if change.target is None or not (body := current.changes_to(change.target)):
                results.append(ChangeResult(change.pod, current))
                continue
            applied = await admin.apply(endpoint, body)
        except AdminError as exc:
            results.append(ChangeResult(change.pod, None, str(exc)))
            continue
        results.append(ChangeResult(change.pod, applied.config, before=current, duration_s=applied.duration_s,
                                    pause_s=applied.relayout_pause_s))
    return results


async def tune(state: TunerState, inputs: TuningInputs, admin: AdminClient | None) -> TuningStep:
    """One pass: plan, call the pods, settle."""
    step = plan(state, inputs)
    return settle(step, await execute(step, admin, inputs.endpoints), inputs)


def settle(plan: Plan, results: list[ChangeResult], inputs: TuningInputs) -> TuningStep:
    state, now, coordination = plan.state, inputs.now, inputs.coordination
    outcomes = state.outcomes
    pods = dict(state.pods)
    for r in results:
        if r.config is not None:
            pods[r.pod] = Knobs.of(r.config)
        if r.pause_s is not None and r.before is not None and r.config is not None:
            outcomes = outcomes.copy() if outcomes is state.outcomes else outcomes
            outcomes.record_pause(Knobs.of(r.before).engine, Knobs.of(r.config).engine, r.pause_s)
    state = replace(state, pods=pods, outcomes=outcomes)
    failed = [r for r in results if r.config is None]
    step = TuningStep(state, coordination, plan.events, action=plan.action, calls=tuple(results))
    return _SETTLE[plan.action](step, plan, results, failed, now)


def _add(step: TuningStep, *, events: tuple[Event, ...] = (), records: tuple[DecisionRecord, ...] = (),
         **changes: object) -> TuningStep:
    return replace(step, events=step.events + events, records=step.records + records, **changes)  # type: ignore[arg-type]


def _settle_wait(step: TuningStep, plan: Plan, results: list[ChangeResult], failed: list[ChangeResult],
                 now: float) -> TuningStep:
    return replace(step, outcome="skipped" if plan.decision is not None else None)


def _settle_read(step: TuningStep, plan: Plan, results: list[ChangeResult], failed: list[ChangeResult],
                 now: float) -> TuningStep:
    state = step.state
    if failed:
        return replace(step, state=replace(state, condition=_tuned(False, "AdminCallFailed", failed[0].error)))
    config = results[0].config
    canary = state.canary
    if canary is not None and canary.previous is None:
        canary = replace(canary, previous=config)
    return replace(step, state=replace(state, config=config, canary=canary))


def _settle_converge(step: TuningStep, plan: Plan, results: list[ChangeResult], failed: list[ChangeResult],
                     now: float) -> TuningStep:
    config = step.state.config
    assert config is not None
    events = tuple(Event("Normal", "TuningConverged", f"pod {r.pod} brought to the service's {short(config)}")
                   for r in results if r.config is not None)
    if failed:
        message = f"could not bring pod {failed[0].pod} to the config in force: {failed[0].error}"
        return _add(step, events=events + (Event("Warning", "AdminCallFailed", failed[0].error),),
                    state=replace(step.state, condition=_tuned(False, "AdminCallFailed", message)))
    return _add(step, events=events)


def _settle_canary(step: TuningStep, plan: Plan, results: list[ChangeResult], failed: list[ChangeResult],
                   now: float) -> TuningStep:
    decision, state = plan.decision, step.state
    assert decision is not None and decision.target is not None and state.config is not None
    target, pod = decision.target, plan.changes[0].pod
    if failed:
        message = (f"the canary change to {short(target)} was refused; the service stays on "
                   f"{short(state.config)}: {failed[0].error}")
        return _add(step, events=(Event("Warning", "AdminCallFailed", message),),
                    state=replace(state, attempted=now, condition=_tuned(False, "AdminCallFailed", message)))
    record = dataclasses.replace(tune_record(decision, now), reason=f"canary on pod {pod}: {decision.reason}")
    message = f"pod {pod} tries {short(target)}: {decision.reason}"
    event = Event("Normal", "TuningCanary", f"pod {pod} tries {short(target)} (from {short(state.config)}): "
                                            f"{decision.reason}")
    state = replace(state, canary=Canary(pod, now, target, state.config, decision.reason),
                    condition=_tuned(None, "CanaryInProgress", message))
    return _add(step, state=state, coordination=step.coordination.tuning_started(), outcome="canary",
                records=(record,), events=(event,))


def _settle_rollout(step: TuningStep, plan: Plan, results: list[ChangeResult], failed: list[ChangeResult],
                    now: float) -> TuningStep:
    decision = plan.decision
    assert decision is not None and decision.target is not None
    target = decision.target
    message = f"{short(target)} goes into the Deployment's flags: {decision.reason}"
    state = replace(step.state, config=target, tuned=target, last_change=now,
                    condition=_tuned(True, "RollingOut", message))
    return _add(step, state=state, coordination=step.coordination.tuning_settled(now), outcome="applied",
                records=(tune_record(decision, now),),
                events=(Event("Normal", "Tuned", f"rolling out {short(target)}: {decision.reason}"),))


def _ended(step: TuningStep, now: float, record: DecisionRecord, **changes: object) -> TuningStep:
    """The canary ends: the change and its verdict go into the history."""
    state = replace(step.state, canary=None, last_change=now, **changes)  # type: ignore[arg-type]
    return _add(step, state=state, coordination=step.coordination.tuning_settled(now), records=(record,))


def _settle_promote(step: TuningStep, plan: Plan, results: list[ChangeResult], failed: list[ChangeResult],
                    now: float) -> TuningStep:
    canary = step.state.canary
    assert canary is not None and canary.previous is not None
    message = f"{short(canary.target)} promoted from pod {canary.pod} to every pod: {plan.reason}"
    tuned = (_tuned(False, "AdminCallFailed", f"{message}; not yet on: {'; '.join(r.error for r in failed)}")
             if failed else _tuned(True, "Promoted", message))  # the next passes converge those
    pods = {**step.state.pods, canary.pod: Knobs.of(canary.target)}
    record = DecisionRecord(now, "tune", short(canary.previous), short(canary.target),
                            f"promoted from pod {canary.pod}: {plan.reason}")
    step = _ended(step, now, record, config=canary.target, tuned=canary.target, pods=pods, condition=tuned)
    return _add(step, outcome="promoted", events=(Event("Normal", "TuningPromoted", message),))


def _settle_roll_back(step: TuningStep, plan: Plan, results: list[ChangeResult], failed: list[ChangeResult],
                      now: float) -> TuningStep:
    canary = step.state.canary
    assert canary is not None and canary.previous is not None
    message = f"pod {canary.pod} back to {short(canary.previous)}: {plan.reason}"
    if failed:  # the next passes converge it
        message = f"{message}; the pod has not taken it yet: {failed[0].error}"
    record = DecisionRecord(now, "tune", short(canary.target), short(canary.previous),
                            f"rolled back on pod {canary.pod}: {plan.reason}")
    step = _ended(step, now, record, condition=_tuned(True, "RolledBack", message))
    return _add(step, outcome="rolled_back", events=(Event("Warning", "TuningRolledBack", message),))


def _settle_lost(step: TuningStep, plan: Plan, results: list[ChangeResult], failed: list[ChangeResult],
                 now: float) -> TuningStep:
    canary = step.state.canary
    assert canary is not None and canary.previous is not None
    message = f"canary pod {canary.pod} went away; the service stays on {short(canary.previous)}"
    step = _ended(step, now, DecisionRecord(now, "tune", short(canary.target), short(canary.previous), message),
                  condition=_tuned(True, "CanaryLost", message))
    return _add(step, events=(Event("Warning", "TuningCanaryLost", message),))


_SETTLE = {"wait": _settle_wait, "read": _settle_read, "converge": _settle_converge, "canary": _settle_canary,
           "rollout": _settle_rollout, "promote": _settle_promote, "roll_back": _settle_roll_back,
           "lost": _settle_lost}
