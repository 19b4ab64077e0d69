"""Scheduling policies (fcfs, priority with aging, fair = VTC): mostly on the scheduler alone with a
simulated step (no model, fast), then on the engine with a tiny model for output equality."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import defaultdict

import pytest

from kvpilot.runtime.config import SchedulerConfig
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sched.block_manager import BlockManager
from kvpilot.runtime.sched.policies import FairPolicy
from kvpilot.runtime.sched.scheduler import Scheduler, SchedulerOutput
from kvpilot.runtime.sched.sequence import Request, SequenceStatus

PROMPT_LEN, MAX_TOKENS = 24, 16
W_P, W_Q = 1.0, 2.0  # the paper's weights, the defaults


class Sim:
    """A scheduler stepped as the engine would: computed counts advance, sampled tokens are
    appended (token 0), sequences finish at max_tokens. Records, per step, each tenant's weighted
    service and which tenants were backlogged (waiting or swapped) when the step was scheduled."""

    def __init__(self, policy: str, num_blocks: int = 64, block_size: int = 16, **kw: object) -> None:
        config = SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 512,
                                    "scheduler_policy": policy, **kw})  # type: ignore[arg-type]
        self.sched = Scheduler(config, BlockManager(num_blocks, block_size))
        self.step_no = 0
        self.ids = itertools.count()
        self.seq_ids = itertools.count()  # the engine's sequence numbering
        self.service: list[dict[str, float]] = []
        self.backlogged: list[set[str]] = []
        self.arrival_step: dict[str, int] = {}
        self.first_token_step: dict[str, int] = {}
        self.finished: list[Request] = []
        self.admitted: list[str] = []

    def add(self, tenant: str, prompt_len: int = PROMPT_LEN, max_tokens: int = MAX_TOKENS, priority: int = 0,
            arrival: float | None = None) -> Request:
        rid = f"{tenant}-{next(self.ids)}"
        request = Request(rid, None, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens),
                          arrival_time=float(self.step_no) if arrival is None else arrival, priority=priority,
                          tenant=tenant, seq_ids=self.seq_ids)
        self.arrival_step[rid] = self.step_no
        for seq in request.seqs:
            self.sched.add(seq)
        return request

    def step(self) -> SchedulerOutput:
        self.backlogged.append({s.request.tenant for s in itertools.chain(self.sched.waiting, self.sched.swapped)})
        out = self.sched.schedule()
        self.service.append({t: W_P * p + W_Q * g for t, (p, g) in out.served_tokens.items()})
        for s in out.scheduled:
            seq, request = s.seq, s.seq.request
            if request.request_id not in self.admitted:
                self.admitted.append(request.request_id)
            samples = s.samples
            seq.num_computed_tokens += s.num_new_tokens
            if samples:
                seq.token_ids.append(0)
                self.first_token_step.setdefault(request.request_id, self.step_no)
                if seq.num_output_tokens >= request.params.max_tokens:
                    self.sched.finish(seq)
                    self.finished.append(request)
        self.step_no += 1
        return out

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.num_unfinished and max_steps:
            self.step()
            max_steps -= 1
        assert not self.sched.num_unfinished, "the run did not finish"

    def ttft(self, rid: str) -> int:
        return self.first_token_step[rid] - self.arrival_step[rid]

    def max_service_gap(self, a: str, b: str, steps: list[int]) -> float:
        """max over sub-intervals [i, j] of `steps` (consecutive steps) of |W_a - W_b|."""
        diffs = [self.service[k].get(a, 0.0) - self.service[k].get(b, 0.0) for k in steps]
        prefix = [0.0, *itertools.accumulate(diffs)]
        return max(prefix) - min(prefix)  # the largest |sum| over any run of consecutive steps


def both_backlogged(sim: Sim, a: str, b: str) -> list[int]:
    steps = [k for k, tenants in enumerate(sim.backlogged) if {a, b} <= tenants]
    assert steps == list(range(steps[0], steps[-1] + 1)), "expected one backlogged interval"
    return steps


def paper_bound(sim: Sim, max_prompt_len: int) -> float:
    """Sheng et al. (OSDI 2024), Theorem 4.4: over any interval in which tenants f and g are both
    backlogged, |W_f - W_g| <= 2U with U = max(w_p * L_input, w_q * M): L_input the longest prompt,
    M the most tokens the KV cache holds (blocks x block size)."""
    bm = sim.sched.block_manager
    return 2 * max(W_P * max_prompt_len, W_Q * bm.num_blocks * bm.block_size)


def ten_to_one_backlog(policy: str, num_light: int = 30) -> Sim:
    """Both tenants backlogged from the start: heavy queued ten requests for each of light's, in
    arrival order interleaved as their rates would be. KV for 160 tokens (M), 4 sequences at once."""
    sim = Sim(policy, num_blocks=10, block_size=16)
    for i in range(11 * num_light):
        sim.add("light" if i % 11 == 5 else "heavy")
    sim.run()
    return sim


# ---- fair share ---------------------------------------------------------------------------------

def test_fcfs_lets_the_heavy_tenant_take_nearly_all_tokens() -> None:
    sim = ten_to_one_backlog("fcfs")
    steps = both_backlogged(sim, "heavy", "light")
    heavy = sum(sim.service[k].get("heavy", 0.0) for k in steps)
    light = sum(sim.service[k].get("light", 0.0) for k in steps)
    assert heavy / (heavy + light) > 0.85
    assert sim.max_service_gap("heavy", "light", steps) > 4 * paper_bound(sim, PROMPT_LEN)


def test_fair_keeps_backlogged_tenants_within_the_papers_bound() -> None:
    sim = ten_to_one_backlog("fair")
    steps = both_backlogged(sim, "heavy", "light")
    assert len(steps) > 100  # long enough for fcfs to break the bound many times over (above)
    assert sim.max_service_gap("heavy", "light", steps) <= paper_bound(sim, PROMPT_LEN)
    heavy = sum(sim.service[k].get("heavy", 0.0) for k in steps)
    light = sum(sim.service[k].get("light", 0.0) for k in steps)
    assert 0.4 < light / (heavy + light) < 0.6


def open_loop_10_to_1(policy: str, num_steps: int = 600) -> Sim:
    """Heavy sends ten requests for each of light's; together they ask for ~4x what the engine
    serves (4 slots, ~16 steps a request), light alone ~1/3 of it: under its fair half."""
    sim = Sim(policy, num_blocks=64, block_size=16)
    for k in range(num_steps):
        if k % 12 == 0:
            sim.add("light")
        elif k % 12 != 6:
            sim.add("heavy")
        sim.step()
    return sim


def test_fair_bounds_the_light_tenants_ttft_while_fcfs_lets_it_grow() -> None:
    fair, fcfs = open_loop_10_to_1("fair"), open_loop_10_to_1("fcfs")
    # a light request waits at most for the next free slot after one tie-winning heavy admission:
    # two requests' service time (1 prefill + 15 decode steps each), however long the run
    bound = 2 * MAX_TOKENS
    fair_ttft = [fair.ttft(r) for r in fair.first_token_step if r.startswith("light")]
    assert len(fair_ttft) >= 45 and max(fair_ttft) <= bound
    fcfs_ttft = [fcfs.ttft(r) for r in fcfs.first_token_step if r.startswith("light")]
    assert max(fcfs_ttft) > 5 * bound  # behind the heavy queue, which only grows
    unserved = [r for r in fcfs.arrival_step if r.startswith("light") and r not in fcfs.first_token_step]
    assert len(unserved) > 20


def test_returning_idle_tenant_gets_no_banked_credit() -> None:
    sim = Sim("fair", num_blocks=10, block_size=16)
    for i in range(120):
        sim.add("a" if i % 2 else "b")
    for _ in range(300):
        sim.step()
    policy = sim.sched.policy
    assert isinstance(policy, FairPolicy)
    bound = paper_bound(sim, PROMPT_LEN)
    floor = min(policy.counter("a"), policy.counter("b"))
    assert floor > 3 * bound  # credit for 300 idle steps would dwarf the bound
    arrival = sim.step_no
    for _ in range(40):
        sim.add("c")
    assert policy.counter("c") == floor  # lifted to the smallest backlogged counter
    sim.run()
    steps = [k for k in both_backlogged(sim, "a", "c") if k >= arrival]
    assert sim.max_service_gap("c", "a", steps) <= bound
    assert sim.max_service_gap("c", "b", steps) <= bound


def test_fair_lifts_a_tenant_returning_to_an_empty_queue_to_the_last_one_served() -> None:
    sim = Sim("fair")
    sim.add("a", prompt_len=40)
    sim.step()  # a admitted: the queue is empty, a left it last
    policy = sim.sched.policy
    assert isinstance(policy, FairPolicy) and policy.counter("a") == 40 * W_P + W_Q
    sim.add("b")
    assert policy.counter("b") == policy.counter("a")


def test_fair_preempts_the_tenant_with_the_largest_counter_and_budgets_the_smallest_first() -> None:
    sim = Sim("fair", num_blocks=4, block_size=4, max_num_batched_tokens=64)
    policy = sim.sched.policy
    assert isinstance(policy, FairPolicy)
    rich, poor = sim.add("rich", prompt_len=7), sim.add("poor", prompt_len=7)
    policy.counters["rich"] += 1000  # as if it had been served much more before
    sim.step()
    sim.step()
    assert [s.request.tenant for s in sim.sched.running] == ["poor", "rich"]
    out = sim.step()  # both need a third block; only one fits
    assert out.preempted == [rich.seqs[0]]
    assert [s.seq for s in out.scheduled] == [poor.seqs[0]]


def test_fair_admits_the_backlogged_tenant_with_the_smallest_counter_oldest_first() -> None:
    sim = Sim("fair", max_num_seqs=1)
    for tenant in ("x", "x", "x", "y", "y"):
        sim.add(tenant, prompt_len=8, max_tokens=1)
    sim.run()
    # x admitted first (first in queue at equal counters); then y (smaller); and so on
    assert sim.admitted == ["x-0", "y-3", "x-1", "y-4", "x-2"]


def test_served_tokens_count_each_prompt_token_and_output_once_despite_recompute() -> None:
    sim = Sim("fcfs", num_blocks=6, block_size=4, max_num_batched_tokens=16)
    requests = [sim.add(t, prompt_len=n, max_tokens=9) for t, n in (("a", 10), ("b", 7), ("c", 12))]
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    preempted = 0
    while sim.sched.num_unfinished:
        out = sim.step()
        preempted += len(out.preempted)
        for tenant, (p, g) in out.served_tokens.items():
            totals[tenant][0] += p
            totals[tenant][1] += g
    assert preempted > 0  # the recompute re-prefills are not counted again
    assert dict(totals) == {r.tenant: [len(r.prompt_token_ids), 9] for r in requests}


# ---- priority with aging ------------------------------------------------------------------------

def test_priority_aging_serves_the_oldest_low_priority_request_within_the_bound() -> None:
    """One step stands for one second. Urgent requests (priority 0) arrive one per step, faster
    than the one slot serves them, so strict priority would starve priority 5 forever. With
    --priority-aging 2, the bound says: a priority-5 request arriving at t is overtaken only by
    priority-0 requests arriving up to t + 5 * 2."""
    aging = 2.0
    sim = Sim("priority", max_num_seqs=1, priority_aging_s=aging)
    old_low = sim.add("t", prompt_len=4, max_tokens=2, priority=5, arrival=0.0)
    young_low = sim.add("t", prompt_len=4, max_tokens=2, priority=5, arrival=0.5)
    urgent_arrival = {}
    for _ in range(60):
        urgent = sim.add("t", prompt_len=4, max_tokens=2, priority=0, arrival=float(sim.step_no) + 1)
        urgent_arrival[urgent.request_id] = urgent.arrival_time
        sim.step()
    order = sim.admitted
    assert old_low.request_id in order and young_low.request_id in order
    assert order.index(old_low.request_id) < order.index(young_low.request_id)
    for rid, arrived in urgent_arrival.items():
        if rid not in order:
            assert arrived > 5 * aging
            continue
        before = order.index(rid) < order.index(old_low.request_id)
        assert before == (arrived <= 0.0 + 5 * aging), (rid, arrived)


def test_priority_aging_is_a_documented_positive_parameter() -> None:
    with pytest.raises(ValueError, match="priority_aging"):
        SchedulerConfig(priority_aging_s=0)
    with pytest.raises(ValueError, match="fair_output_weight"):
        SchedulerConfig(fair_output_weight=-1)


# ---- live switch --------------------------------------------------------------------------------

def test_live_policy_switches_lose_no_request_and_no_token() -> None:
    rng = random.Random(7)
    sim = Sim("fcfs", num_blocks=12, block_size=4, max_num_batched_tokens=24)
    requests = [sim.add(rng.choice("abc"), prompt_len=rng.randrange(3, 20), max_tokens=rng.randrange(1, 12),
                        priority=rng.randrange(3)) for _ in range(30)]
    policies = itertools.cycle(["fair", "priority", "fcfs", "fair"])
    served = defaultdict(lambda: [0, 0])
    while sim.sched.num_unfinished:
        if sim.step_no % 5 == 4:
            sim.sched.config = dataclasses.replace(sim.sched.config, scheduler_policy=next(policies))
        for tenant, (p, g) in sim.step().served_tokens.items():
            served[tenant][0] += p
            served[tenant][1] += g
        assert sim.step_no < 2000
    assert sorted(r.request_id for r in sim.finished) == sorted(r.request_id for r in requests)
    for r in requests:
        assert r.seqs[0].status is SequenceStatus.FINISHED and r.seqs[0].num_output_tokens == r.params.max_tokens
    expected: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in requests:
        expected[r.tenant][0] += len(r.prompt_token_ids)
        expected[r.tenant][1] += r.params.max_tokens
    assert dict(served) == dict(expected)
    assert sim.sched.block_manager.num_free_blocks == sim.sched.block_manager.num_blocks


# ---- on the engine (tiny random-weight model) ---------------------------------------------------

def _engine_workload(seed: int = 11) -> list[tuple[str, str, list[int], int]]:
    """(request id, tenant, prompt, priority): three tenants, one sending most of the load."""
    rng = random.Random(seed)
    work = []
    for i in range(12):
        tenant = "heavy" if i % 4 else rng.choice(["light", "other"])
        work.append((f"r{i}", tenant, [rng.randrange(256) for _ in range(rng.randrange(5, 60))], rng.randrange(3)))
    return work


def _run_engine(folder: str, policy: str, switches: dict[int, str] | None = None) -> dict[str, list[int]]:
    from kvpilot.runtime import LLM

    # 10 blocks of 8 tokens for 3 sequences of up to ~80 tokens: preemptions happen
    engine = LLM(folder, max_model_len=80, block_size=8, num_gpu_blocks_override=10, max_num_seqs=3,
                 max_num_batched_tokens=32, scheduler_policy=policy).engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for rid, tenant, prompt, priority in _engine_workload():
        engine.add_request(rid, prompt, params, priority=priority, tenant=tenant)
    done: dict[str, list[int]] = {}
    for step in range(2000):
        if switches and step in switches:
            engine.update_config({"scheduler_policy": switches[step]})
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done


def test_greedy_outputs_under_fair_equal_fcfs_request_by_request(tiny_models) -> None:
    folder, _ = tiny_models["llama"]
    fcfs = _run_engine(folder, "fcfs")
    assert sorted(fcfs) == sorted(rid for rid, *_ in _engine_workload())
    for policy in ("fair", "priority"):
        outputs = _run_engine(folder, policy)
        assert outputs == fcfs
        assert list(outputs) != list(fcfs)  # finished in another order: the schedule did differ


def test_live_policy_switch_mid_run_loses_nothing(tiny_models) -> None:
    folder, _ = tiny_models["llama"]
    reference = _run_engine(folder, "fcfs")
    switched = _run_engine(folder, "fcfs", {3: "fair", 9: "priority", 15: "fair", 30: "fcfs", 40: "fair"})
    assert switched == reference
