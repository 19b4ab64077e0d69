"""The fleet simulator: the replicas of one InferenceService under an arrival trace, scaled by a
policy, each replica modelled by a measured capacity curve (`capacity_curve.py`).

Time advances in ticks. In each tick:
* requests arrive (Poisson at the trace's rate) and each goes to a Ready replica chosen at random,
  as a Service spreads them; with no Ready replica they fail;
* every Ready replica is offered rate / Ready replicas. It completes up to its capacity; the
  excess waits in its own queue (a fluid backlog drained at the capacity, which a new replica
  does not take over), whose wait adds to TTFT and E2E; clients give up past `request_timeout_s`,
  so no queue holds more than that much work. A request's latencies are drawn from the curve at
  the offered rate, or at the capacity while its replica has a queue, one draw for TTFT, ITL and
  E2E (a request slow to start is slow to finish);
* a replica serves its requests at the speed of the load it carries now, not of the load each
  arrived at: it keeps a clock of work in E2E P50s at its current load (a request drawn at 1.2
  times the P50 needs 1.2 of them), and a request is done when the clock has advanced by its
  work. At a steady load that is its drawn E2E; when a removed replica stops receiving requests,
  it serves its queue at the capacity, then the rest at the lowest-load speed (`drain_s`). That
  is what the measured finite runs show: their last answer came about the lowest rate's E2E after
  the last send, whatever the E2E at the offered rate (benchmarks/history/2026-12-04.md, "The
  drain modelled"); a new request's prefill, not the batch it joins, slows the others;
* preemptions are counted at the curve's rate, and each TTFT in the runtime's histogram buckets.
Scrapes, every `Pipeline.scrape_interval_s` from `Pipeline.phase_s`, record each Ready
replica's gauges and counters (`autoscale_scrapes.py`). The ticks between two events (a scrape,
a decision, a replica Ready, a minute's end) are served in one go.
Each mode decides as it does in a cluster (`autoscale_modes.py`): builtin every `spec.interval`
on the operator's own scrapes, taken as it decides, through `decide_replicas` and, with a
forecast, `look_ahead`; hpa and keda every HPA sync on Prometheus's scrapes as the chart's
adapter rules and the ScaledObject's query read them. A reference fleet with `Foresight` reads
the trace's rate instead. The fleet follows at once: a new replica is Pending for `pending_s`,
then loads the model (Running, not Ready, never scraped) until `startup_s`; a removed one
leaves the load balancer at once and drains, costing until its last request finishes
(`drain_s`). Only the drain moves a finish: a request's E2E in the results (and the E2E SLO) is
its draw at its arrival's load. The replica removed is a starting one first (the ReplicaSet's
order), then the one of lowest pod-deletion-cost (the operator's `deletion_costs`), then the
newest.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvpilot.bench.arrival_trace import Trace
from kvpilot.bench.autoscale_modes import Phase, hpa_decision, keda_decision
from kvpilot.bench.autoscale_scrapes import TTFT_BUCKETS, Scrape, draw_gauges, summarize
from kvpilot.bench.capacity_curve import LATENCIES, CapacityCurve, sample, share_within
from kvpilot.bench.fleet_inputs import Foresight, Policy, SimConfig
from kvpilot.operator.autoscale import (
    PodState,
    ScalerState,
    ScalingSpec,
    decide_replicas,
    deletion_costs,
)
from kvpilot.operator.autoscale.behavior import normalize
from kvpilot.operator.autoscale.forecast import RateSeries, look_ahead
from kvpilot.operator.autotune import WindowSummary

_BOUNDS = np.array(TTFT_BUCKETS)
_TTFT, _E2E = LATENCIES.index("ttft"), LATENCIES.index("e2e")


@dataclass
class _Replica:
    slot: int  # its row in the simulation's arrays
    name: str
    created: float
    running_at: float  # Pending until then
    ready_at: float
    removed_at: float | None = None
    scrapes: deque[Scrape] = field(default_factory=deque)
    cost: str | None = None  # the pod-deletion-cost annotation

    def phase(self, now: float) -> Phase:
        if self.removed_at is not None:
            return "leaving"
        if self.ready_at <= now:
            return "ready"
        return "loading" if self.running_at <= now else "pending"

    def state(self, now: float) -> PodState:
        phase = self.phase(now)
        return "starting" if phase in ("pending", "loading") else phase


@dataclass
class FleetResult:
    policy: str
    num_requests: int = 0
    num_met: int = 0
    num_failed: int = 0  # arrived with no Ready replica
    replica_seconds: float = 0.0
    num_scale_events: int = 0
    max_replicas: int = 0
    # per minute: its end, mean rate, replicas (not removed), Ready replicas, share meeting the SLO
    timeline: list[tuple[float, float, int, int, float]] = field(default_factory=list)
    latencies: dict[str, list[np.ndarray]] = field(default_factory=lambda: {k: [] for k in LATENCIES})
    duration_s: float = 0.0

    @property
    def slo_attainment(self) -> float:
        return self.num_met / self.num_requests if self.num_requests else 1.0

    @property
    def replica_hours(self) -> float:
        return self.replica_seconds / 3600


def simulate(curve: CapacityCurve, trace: Trace, policy: Policy, config: SimConfig, *,
             record_latencies: bool = False, progress: Callable[[int], None] | None = None) -> FleetResult:
    return _Simulation(curve, trace, policy, config, record_latencies, progress).run()


def e2e_p50(curve: CapacityCurve, load: float) -> float:
    """The unit of a replica's clock at `load`: seconds per E2E P50 of work."""
    return float(curve.percentiles("e2e", load)[0])


def drain_s(curve: CapacityCurve, work: float, backlog: float) -> float:
    """Seconds a replica that stops receiving requests takes to finish those it holds: `work`,
    its last request's remaining E2E in P50s (`finish - clock`), behind `backlog` queued requests.
    The queue is served at the capacity, in which time the clock runs at the capacity's speed;
    the rest at the lowest load's, the curve's first point (it holds below it)."""
    queued_s = backlog / curve.capacity
    at_capacity = e2e_p50(curve, curve.capacity)
    if work * at_capacity <= queued_s:
        return work * at_capacity
    return queued_s + (work - queued_s / at_capacity) * e2e_p50(curve, 0.0)


class _Simulation:
    """The replicas' hot state (backlog, counters, last finish) lives in arrays indexed by
    `_Replica.slot`, so a tick costs a few array operations whatever the fleet's size."""

    def __init__(self, curve: CapacityCurve, trace: Trace, policy: Policy, config: SimConfig,
                 record_latencies: bool, progress: Callable[[int], None] | None) -> None:
        self.curve, self.trace, self.policy, self.config = curve, trace, policy, config
        self.record = record_latencies
        self.progress = progress
        self.rng = np.random.default_rng(config.seed)
        # arrivals from a stream of their own, so every policy is offered the very same requests
        self.arrivals = np.random.default_rng([config.seed, 1])
        self.result = FleetResult(policy.name)
        self.rates = trace.tick_rates(config.tick_s)
        self.replicas: list[_Replica] = []
        self.gone: deque[_Replica] = deque()  # removed, while their scrapes may still be in a query's range
        self.state = ScalerState()
        self.series = RateSeries()  # builtin's arrival rate, one point a decision
        self.backlog = np.zeros(0)  # requests beyond the capacity, waiting
        self.preemptions = np.zeros(0)
        self.arrived = np.zeros(0)
        self.clock = np.zeros(0)  # work served, in E2E P50s at the load of the moment
        self.finish = np.zeros(0)  # the clock's reading when the last request sent to it is done
        self.busy_until = np.zeros(0)  # a removed replica's: when its last request is done
        self.ttft = np.zeros((0, len(TTFT_BUCKETS) + 1))
        spec = policy.spec
        self.decide_every = math.inf if spec is None else (
            spec.interval if spec.mode == "builtin" else config.cluster.hpa_sync_s)
        window = 0.0 if spec is None else max(spec.window, config.cluster.adapter_window_s)
        self.keep_s = window + 2 * max(policy.pipeline.scrape_interval_s, self.decide_every if spec else 0.0)
        self.reads_ttft = spec is not None and spec.metric == "ttftP99"  # else no summary carries a histogram
        self.ready: list[_Replica] = []
        self.slots = np.zeros(0, dtype=np.int64)
        self.next_ready = math.inf
        for _ in range(policy.initial_replicas):
            self._add(0.0, ready_at=0.0)

    def run(self) -> FleetResult:
        tick, rates = self.config.tick_s, self.rates
        spec, pipeline = self.policy.spec, self.policy.pipeline
        next_scrape, next_decision = pipeline.phase_s, self.decide_every
        per_minute = max(1, round(60 / tick))
        self._refresh_ready(0.0)
        minute = [0.0, 0.0, 0.0]  # arrivals, met, sum of rates
        k, total = 0, len(rates)
        while k < total:
            now = k * tick
            if now >= self.next_ready:
                self._refresh_ready(now)
            # ticks up to the next event are served in one go: the Ready replicas stay as they are
            last = min(total, (k // per_minute + 1) * per_minute) - 1
            for when in (next_scrape, next_decision, self.next_ready - tick):
                if when < last * tick:
                    last = max(k, math.ceil(round(when / tick, 9)))
            self._serve(k, last + 1, minute)
            now = last * tick
            if now >= next_scrape:
                self._scrape(now, float(rates[last]))
                next_scrape += pipeline.scrape_interval_s
            if spec is not None and now >= next_decision:
                self._decide(now, spec)
                next_decision += self.decide_every
            if (last + 1) % per_minute == 0:
                self._record_minute(now, minute)
            if self.progress is not None and (last + 1) // 3600 > k // 3600:
                self.progress(3600)
            k = last + 1
        if self.progress is not None:
            self.progress(total % 3600)
        end = total * tick
        self.result.duration_s = end
        self.result.replica_seconds = sum(
            min(end, float(self.busy_until[r.slot]) if r.removed_at is not None else end) - r.created
            for r in self.replicas)
        return self.result

    def _serve(self, first: int, end: int, minute: list[float]) -> None:
        """Ticks [first, end), with the same Ready replicas throughout."""
        tick, cap = self.config.tick_s, self.curve.capacity
        rates = self.rates[first:end]
        counts = self.arrivals.poisson(rates * tick)
        arrivals = int(counts.sum())
        self.result.num_requests += arrivals
        minute[0] += arrivals
        minute[2] += float(rates.sum())
        n = len(self.slots)
        if n == 0:
            self.result.num_failed += arrivals
            return
        slots, ticks = self.slots, len(rates)
        offered = rates / n
        calm = np.minimum(offered, cap)
        # each tick's backlog, (ticks, n): clients give up on a request that would wait past the
        # timeout, so no queue holds more than that
        limit, backlog = cap * self.config.request_timeout_s, self.backlog[slots]
        before, after = np.zeros((ticks, n)), np.zeros((ticks, n))
        if backlog.any() or offered.max() > cap:
            for i, step in enumerate(((offered - cap) * tick).tolist()):
                before[i] = backlog
                backlog = np.clip(backlog + step, 0.0, limit)
                after[i] = backlog
            self.backlog[slots] = backlog
        queued = after > 0  # serving at its capacity, whatever it is offered
        table = self.curve.latencies_at(np.append(calm, cap))  # (ticks + 1, kinds, 3): the last at capacity
        p50 = table[:, _E2E, 0]
        speed = np.where(queued, 1 / p50[-1], 1 / p50[:-1, None])
        served = speed * tick
        clock = self.clock[slots] + np.cumsum(served, axis=0) - served  # at each tick's start
        self.clock[slots] += served.sum(axis=0)
        if "preemptions_per_s" in self.curve.gauges:
            per_s = self.curve.gauge_at("preemptions_per_s", np.append(calm, cap))
            self.preemptions[slots] += np.where(queued, per_s[-1], per_s[:-1, None]).sum(axis=0) * tick
        if arrivals == 0:
            return
        # requests counted by tick and replica, each going to a Ready replica at random; a cell's
        # latencies follow its row of the curve (at the capacity while the replica queues) plus
        # its wait, so what is counted of them comes from the distribution, not from draws
        split = self.rng.multinomial(counts, np.full(n, 1 / n))  # (ticks, n)
        self.arrived[slots] += split.sum(axis=0)
        rows = table[np.where(queued, ticks, np.arange(ticks)[:, None])]  # (ticks, n, kinds, 3)
        wait = (before + after) / (2 * cap)
        within = share_within(rows[..., _TTFT, :], self.config.slo_ttft_s - wait)
        if self.config.slo_e2e_s is not None:  # one draw for every kind: both within is the lesser
            within = np.minimum(within, share_within(rows[..., _E2E, :], self.config.slo_e2e_s - wait))
        num_met = int(self.rng.binomial(split, within).sum())
        self.result.num_met += num_met
        minute[1] += num_met
        if self.reads_ttft:
            below = share_within(rows[..., None, _TTFT, :], _BOUNDS - wait[..., None])  # (ticks, n, bounds)
            shares = np.diff(below, prepend=0.0, append=1.0, axis=-1)
            self.ttft[slots] += self.rng.multinomial(split, shares).sum(axis=0)
        # the last to finish of a cell's requests is the slowest of them: the largest of `split`
        # exponential draws, -ln(1 - V^(1/split))
        busy = split > 0
        slowest = -np.log1p(-self.rng.random(split.shape) ** (1 / np.maximum(split, 1)))
        e2e = sample(rows[..., _E2E, :], slowest) + wait
        done = np.where(busy, clock + e2e * speed, -np.inf).max(axis=0)
        self.finish[slots] = np.maximum(self.finish[slots], done)
        if self.record:
            self._record(split, rows, wait)

    def _record(self, split: np.ndarray, rows: np.ndarray, wait: np.ndarray) -> None:
        """Each request's latencies drawn (the self-check compares their percentiles)."""
        cell = np.repeat(np.arange(split.size), split.ravel())
        u = self.rng.exponential(size=len(cell))
        per_request = rows.reshape(split.size, *rows.shape[2:])[cell]  # (requests, kinds, 3)
        delay = wait.ravel()[cell]
        for i, kind in enumerate(LATENCIES):
            self.result.latencies[kind].append(sample(per_request[:, i], u) + (delay if kind != "itl" else 0.0))

    def _scrape(self, now: float, rate: float) -> None:
        while self.gone and self.gone[0].removed_at < now - self.keep_s:  # type: ignore[operator]
            self.gone.popleft()
        if not self.ready:
            return
        waiting, running, kv = draw_gauges(self.curve, self.rng, rate, self.backlog[self.slots])
        for i, r in enumerate(self.ready):
            r.scrapes.append(Scrape(now, float(waiting[i]), float(running[i]), float(kv[i]),
                                    float(self.preemptions[r.slot]), float(self.arrived[r.slot]),
                                    self.ttft[r.slot].copy()))
            while r.scrapes[0].time < now - self.keep_s:
                r.scrapes.popleft()

    def _decide(self, now: float, spec: ScalingSpec) -> None:
        alive = [r for r in self.replicas if r.removed_at is None]
        # the operator keeps deletion costs in every mode, from its own windows
        window = {r.name: s for r in self.ready if (s := self._summary(r, now, spec.window)) is not None}
        costs = deletion_costs(window, {r.name: r.cost for r in alive})
        for r in alive:
            if r.name in costs:
                r.cost = str(costs[r.name])
        current = len(alive)
        states = {r.name: r.state(now) for r in alive}
        if self.policy.foresight is not None:
            desired, state = self._foresee(now, spec, current, self.policy.foresight)
            scaled_state = state.scaled(now, current, desired, spec.behavior)
        elif spec.mode == "builtin":
            recent = {r.name: s for r in self.ready if (s := self._summary(r, now, spec.interval)) is not None}
            self.series, forecast = look_ahead(self.series, recent, states, now, spec, self.config.startup_s)
            d = decide_replicas(window, states, current, spec, self.state, now=now, forecast=forecast)
            desired, state, scaled_state = d.desired, d.state, d.scaled_state
        elif spec.mode == "hpa":
            adapter = {r.name: s for r in self.ready
                       if (s := self._summary(r, now, self.config.cluster.adapter_window_s, in_range=True))}
            phases = {r.name: r.phase(now) for r in alive}
            desired, state, scaled_state = hpa_decision(adapter, phases, current, spec, self.state, now)
        else:
            means = [s for r in [*alive, *self.gone] if (s := self._summary(r, now, spec.window, in_range=True))]
            desired, state, scaled_state = keda_decision(means, current, spec, self.state, now)
        if desired == current:
            self.state = state
            return
        self.state = scaled_state
        self.result.num_scale_events += 1
        if desired > current:
            for _ in range(desired - current):
                self._add(now, ready_at=now + self.config.startup_s)
        else:
            order = sorted(alive, key=lambda r: (r.state(now) == "ready", int(r.cost or 0), -r.created))
            for r in order[:current - desired]:
                r.removed_at = now
                self.gone.append(r)
                work = max(0.0, float(self.finish[r.slot] - self.clock[r.slot]))
                self.busy_until[r.slot] = now + drain_s(self.curve, work, float(self.backlog[r.slot]))
        self._refresh_ready(now)

    def _foresee(self, now: float, spec: ScalingSpec, current: int, foresight: Foresight) -> tuple[int, ScalerState]:
        tick = self.config.tick_s
        first = round(now / tick)
        ahead = self.rates[first:first + int(foresight.seconds / tick) + 1]
        rate = float(ahead.max()) if len(ahead) else 0.0
        estimate = max(spec.min_replicas, math.ceil(round(rate / foresight.rate_per_replica, 9)))
        n = normalize(estimate, current, spec.min_replicas, spec.max_replicas, spec.behavior, self.state, now)
        return n.replicas, n.state

    def _summary(self, r: _Replica, now: float, window: float, *, in_range: bool = False) -> WindowSummary | None:
        return summarize(r.name, r.scrapes, now, window, in_range=in_range, with_ttft=self.reads_ttft)

    def _add(self, now: float, *, ready_at: float) -> None:
        slot = len(self.replicas)
        if slot == len(self.backlog):  # grow the arrays by doubling
            size = max(8, 2 * slot)
            self.backlog = np.resize(self.backlog, size)
            self.preemptions = np.resize(self.preemptions, size)
            self.arrived = np.resize(self.arrived, size)
            self.busy_until = np.resize(self.busy_until, size)
            self.clock = np.resize(self.clock, size)
            self.finish = np.resize(self.finish, size)
            self.ttft = np.resize(self.ttft, (size, self.ttft.shape[1]))
        self.backlog[slot] = self.preemptions[slot] = self.arrived[slot] = self.busy_until[slot] = 0.0
        self.clock[slot] = self.finish[slot] = 0.0
        self.ttft[slot] = 0.0
        running_at = min(ready_at, now + self.config.pending_s)
        self.replicas.append(_Replica(slot, f"replica-{slot}", now, running_at, ready_at))
        alive = sum(1 for r in self.replicas if r.removed_at is None)
        self.result.max_replicas = max(self.result.max_replicas, alive)

    def _refresh_ready(self, now: float) -> None:
        alive = [r for r in self.replicas if r.removed_at is None]
        self.ready = [r for r in alive if r.ready_at <= now]
        self.slots = np.array([r.slot for r in self.ready], dtype=np.int64)
        self.next_ready = min((r.ready_at for r in alive if r.ready_at > now), default=math.inf)

    def _record_minute(self, now: float, minute: list[float]) -> None:
        alive = sum(1 for r in self.replicas if r.removed_at is None)
        met = minute[1] / minute[0] if minute[0] else 1.0
        self.result.timeline.append((now + self.config.tick_s, minute[2] * self.config.tick_s / 60, alive,
                                     len(self.ready), met))
        minute[:] = [0.0, 0.0, 0.0]
