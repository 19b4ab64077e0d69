"""Scheduling policies: who gets the step's token budget first, which waiting sequence is admitted
next, and which running sequence is preempted when blocks run out. No torch.

The scheduler (scheduler.py) asks its policy three things each step: the order of the running and
swapped sequences (the budget and swap-ins go to the first ones first), the next waiting sequence
to admit (`admission`), and the preemption victim among running sequences (`victim`). It tells the
policy about arrivals (`on_arrival`) and about the tokens it serves (`charge`).

Terms:
* *tenant*: whom a request is served for (`Request.tenant`): the server sets it from the API key's
  identity, else the OpenAI `user` field, else `DEFAULT_TENANT`.
* *backlogged* tenant: one with sequences waiting (or swapped out) for service.
* *served tokens*: prompt tokens computed for the first time and generated tokens. Prefix-cache
  hits and the re-prefill after a recompute preemption are not served again.

Policies:
* `fcfs`: arrival order; the newest running sequence is preempted first.
* `priority`: vLLM's request `priority` (lower first) with linear aging: a waiting request's
  priority improves by one level every `priority_aging_s` seconds. Since every request ages at the
  same rate, that order never changes while requests wait: it is the order of the *virtual arrival*
  `arrival_time + priority * priority_aging_s`. Hence the bound: a request of priority p is never
  overtaken by a request of priority q that arrives more than (p - q) * priority_aging_s seconds
  after it, so a low-priority request is served once the requests ahead of it are, however many
  urgent ones keep arriving. The victim is the running sequence that comes last in that order.
* `fair`: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving Large Language
  Models" (OSDI 2024). Each tenant has a counter of its served tokens weighted `fair_prompt_weight`
  per prompt token and `fair_output_weight` per generated token (the paper's 1 and 2). Admission
  takes the oldest waiting sequence of the backlogged tenant with the smallest counter; the budget
  and swap-ins go to running/swapped sequences in counter order; the victim is the newest running
  sequence of the tenant with the largest counter. A tenant that becomes backlogged again is lifted
  to the smallest counter among backlogged tenants (or, when none is, to the counter of the last
  tenant that left the queue), so time spent idle earns no credit. The paper proves that the
  service (weighted tokens) of two backlogged tenants over any interval differs by at most
  2 * max(w_p * L_input, w_q * M), L_input the longest prompt and M the most tokens the KV cache
  holds. A switch to `fair` starts every counter at zero.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from typing import ClassVar, Protocol

from kvpilot.runtime.config import SchedulerConfig
from kvpilot.runtime.sched.sequence import DEFAULT_TENANT, Sequence


class Queues(Protocol):
    """What a policy reads of the scheduler that calls it (the scheduler imports the policies,
    so they name only this)."""

    waiting: deque[Sequence]
    running: list[Sequence]
    swapped: deque[Sequence]
    backlog: Mapping[str, int]  # tenant -> its requests waiting or swapped out, none at zero


__all__ = ["DEFAULT_TENANT", "AdmissionCursor", "FairPolicy", "FcfsPolicy", "Policy", "PriorityPolicy", "make_policy"]


class AdmissionCursor:
    """The waiting queue in a policy's order: `peek()` the next sequence to admit, `take()` it out
    of the queue once admitted. The scheduler admits at the head only (head-of-line), so a cursor
    is used for one step and then dropped."""

    def __init__(self, waiting: deque[Sequence]) -> None:
        self.waiting = waiting

    def peek(self) -> Sequence | None:
        return self.waiting[0] if self.waiting else None

    def take(self, seq: Sequence) -> None:
        if self.waiting and self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)


class Policy:
    name: ClassVar[str]

    def order(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        """Running or swapped sequences, the most deserving first."""
        return list(seqs)

    def admission(self, waiting: deque[Sequence]) -> AdmissionCursor:
        return AdmissionCursor(waiting)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The running sequence to preempt; `candidates` are in running order, oldest admitted first."""
        return candidates[-1]

    def on_arrival(self, seq: Sequence, scheduler: Queues) -> None:
        """A new sequence is about to join the waiting queue."""

    def charge(self, tenant: str, num_prompt_tokens: int, num_generated_tokens: int) -> None:
        """The scheduler serves these tokens of `tenant` this step."""


class FcfsPolicy(Policy):
    name = "fcfs"


class PriorityPolicy(Policy):
    name = "priority"

    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s

    def key(self, seq: Sequence) -> tuple[float, int, int]:
        r = seq.request
        return r.arrival_time + r.priority * self.aging_s, r.priority, seq.seq_id

    def order(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        return sorted(seqs, key=self.key)

    def admission(self, waiting: deque[Sequence]) -> AdmissionCursor:
        if any(self.key(a) > self.key(b) for a, b in itertools.pairwise(waiting)):
            ordered = deque(sorted(waiting, key=self.key))
            waiting.clear()
            waiting.extend(ordered)
        return AdmissionCursor(waiting)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=self.key)


class _FairCursor(AdmissionCursor):
    """Per step: the waiting queue grouped by tenant (queue order kept within a tenant); the next
    sequence is the head of the group whose tenant has the smallest counter, re-read after every
    admission since admitting charges the counter."""

    def __init__(self, waiting: deque[Sequence], policy: FairPolicy) -> None:
        super().__init__(waiting)
        self.policy = policy
        self.groups: dict[str, deque[Sequence]] = {}
        for seq in waiting:
            self.groups.setdefault(seq.request.tenant, deque()).append(seq)

    def peek(self) -> Sequence | None:
        if not self.groups:
            return None
        tenant = min(self.groups, key=self.policy.counter)  # dict order breaks ties: first in queue
        return self.groups[tenant][0]

    def take(self, seq: Sequence) -> None:
        super().take(seq)
        tenant = seq.request.tenant
        group = self.groups[tenant]
        group.remove(seq)
        if not group:
            del self.groups[tenant]
            self.policy.last_left = tenant


class FairPolicy(Policy):
    name = "fair"
    MAX_IDLE_COUNTERS = 1024  # idle tenants' counters kept before the dispensable ones are dropped

    def __init__(self, prompt_weight: float, output_weight: float) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}
        self.last_left: str | None = None  # the last tenant whose queue emptied by admission

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def order(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        return sorted(seqs, key=lambda s: self.counter(s.request.tenant))  # stable: admission order within

    def admission(self, waiting: deque[Sequence]) -> AdmissionCursor:
        return _FairCursor(waiting, self)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        top = max(self.counter(s.request.tenant) for s in candidates)
        return [s for s in candidates if self.counter(s.request.tenant) == top][-1]

    def on_arrival(self, seq: Sequence, scheduler: Queues) -> None:
        tenant = seq.request.tenant
        backlogged = scheduler.backlog  # tenant -> its requests waiting or swapped out, none at zero
        if tenant in backlogged:
            return
        floor = self._floor(backlogged)
        self.counters[tenant] = max(self.counter(tenant), floor)
        if len(self.counters) > self.MAX_IDLE_COUNTERS:
            self._forget_idle(scheduler, floor)

    def _floor(self, backlogged: Collection[str]) -> float:
        """What a tenant becoming backlogged is lifted to."""
        if backlogged:
            return min(self.counter(t) for t in backlogged)
        return self.counter(self.last_left) if self.last_left is not None else 0.0

    def _forget_idle(self, scheduler: Queues, floor: float) -> None:
        """Drop the counters of tenants with nothing unfinished whose counter is at most the floor:
        the floor never decreases (each arrival is lifted to at least it), so such a tenant would be
        lifted to at least its old counter on return anyway."""
        active = {s.request.tenant for s in itertools.chain(scheduler.waiting, scheduler.swapped, scheduler.running)}
        if self.last_left is not None:
            active.add(self.last_left)
        self.counters = {t: c for t, c in self.counters.items() if t in active or c > floor}

    def charge(self, tenant: str, num_prompt_tokens: int, num_generated_tokens: int) -> None:
        cost = self.prompt_weight * num_prompt_tokens + self.output_weight * num_generated_tokens
        self.counters[tenant] = self.counter(tenant) + cost


def make_policy(config: SchedulerConfig) -> Policy:
    if config.scheduler_policy == "fair":
        return FairPolicy(config.fair_prompt_weight, config.fair_output_weight)
    if config.scheduler_policy == "priority":
        return PriorityPolicy(config.priority_aging_s)
    return FcfsPolicy()
