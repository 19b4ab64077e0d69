"""Continuous batching with chunked prefill. No torch.

Each step the scheduler spends a token budget (`max_num_batched_tokens`) on sequences:
running ones first (a decode costs one token; a half-done prefill continues with its next chunk),
then waiting ones in arrival order, as long as fewer than `max_num_seqs` run. With chunked prefill
a long prompt takes whatever budget is left and finishes over later steps, mixed with decodes;
without it a prompt is admitted only whole. A step therefore has one shape for every case:
"for each scheduled sequence, compute its next `num_new_tokens` tokens".

When a running sequence needs a block and none is free, the policy's victim (the newest running
sequence under fcfs) is preempted. Recompute (`preemption_mode=recompute`): its blocks are freed and it is prefilled
again later. Swap (`preemption_mode=swap`): its blocks are copied to host memory (the swap
space) and freed; it waits in `swapped` and, before any new request is admitted, is copied back
into fresh blocks and continues where it stopped. A swap falls back to recompute when the swap
space is full. The mode is read at each preemption, so it can change live.

The copies are listed in the step's output (`swap_out` before `swap_in`); the model runner issues
them before the step's forward pass and they overlap it (executor/swap.py). A sequence swapped in
therefore runs from the next step on, not in the step that copies it in. It is swapped in only when
the free blocks left afterwards cover the *headroom*: the blocks the running sequences, it
included, need for their next `SWAP_IN_HORIZON` tokens (at least a block). Without it a swap-in
takes the last free blocks, the next sequence to cross a block boundary preempts it again a step
or two later, and swap thrashes (a copy out and back per cycle) where recompute would have waited
(`tests/runtime/sched/test_swap_scheduling.py` replays such a workload without a model).

The policy (policies.py: `fcfs`, `priority` with aging, `fair` per tenant) orders the running and
swapped sequences for the budget, picks the next waiting sequence to admit and the preemption
victim; the scheduler tells it the tokens it serves each step (`SchedulerOutput.served_tokens`,
per tenant, also what the metrics count). The policy too is read every step: a live switch takes
effect at the next step and never touches a sequence's tokens.

With prefix caching, a sequence being admitted first takes the cached blocks of its leading
tokens (block_manager.py) and is scheduled only for the rest; blocks are registered in the cache
once computed, and before a sequence finishes or is preempted, so a recompute finds its own blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvpilot.runtime.config import SchedulerConfig
from kvpilot.runtime.sched.block_manager import BlockManager
from kvpilot.runtime.sched.host_blocks import HostBlockPool
from kvpilot.runtime.sched.policies import Policy, make_policy
from kvpilot.runtime.sched.sequence import Request, Sequence, SequenceStatus

# Decode steps of growth a swap-in leaves room for, for every running sequence (see above).
SWAP_IN_HORIZON = 64


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # this chunk reaches the end of the sequence's tokens, so a token is sampled (fixed when
    # scheduled: it stays true after the step has advanced the sequence)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    num_swapped_out: int = 0  # of `preempted`, the sequences swapped rather than recomputed
    # tenant -> [prompt tokens, generated tokens] served this step (policies.py: "served tokens")
    served_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, num_swap_blocks: int = 0) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.swap_pool = HostBlockPool(num_swap_blocks)
        self.num_swap_blocks = num_swap_blocks
        self.num_preemptions = 0
        self.num_swapped_out = 0  # of the preemptions, those swapped to host memory
        # tenant -> its requests with a sequence waiting or swapped out (policies.py: backlogged),
        # kept as sequences come and go so that nothing scans the queues for it
        self.backlog: dict[str, int] = {}
        self._num_queued: dict[Request, int] = {}  # request -> its sequences waiting or swapped out
        self._policy = make_policy(config)

    @property
    def policy(self) -> Policy:
        """The policy object of `config.scheduler_policy`, rebuilt when the config names another one."""
        if self._policy.name != self.config.scheduler_policy:
            self._policy = make_policy(self.config)
        return self._policy

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def reconfigure(self, config: SchedulerConfig | None = None, *, num_swap_blocks: int | None = None,
                    swap_tables: list[list[int] | None] | None = None) -> list[Sequence]:
        """Live changes: a new `config` (read from the next step on), and/or the swap space re-cut
        into `num_swap_blocks` blocks with each swapped sequence's new `swap_tables` entry (in
        `self.swapped` order; None: it no longer fits and is recomputed instead). Returns the
        sequences sent back to recompute."""
        if config is not None:
            self.config = config
        if num_swap_blocks is None:
            return []
        tables = swap_tables if swap_tables is not None else [None] * len(self.swapped)
        if len(tables) != len(self.swapped):
            raise ValueError(f"{len(tables)} swap tables for {len(self.swapped)} swapped sequences")
        requeued = []
        for seq, table in zip(list(self.swapped), tables, strict=True):
            seq.swap_table = list(table) if table is not None else []
            if table is None:
                requeued.append(seq)
        for seq in reversed(requeued):  # recomputed first, oldest first
            self.swapped.remove(seq)
            self._requeue(seq)
        used = {b for seq in self.swapped for b in seq.swap_table}
        self.swap_pool = HostBlockPool(num_swap_blocks, used=used)
        self.num_swap_blocks = num_swap_blocks
        return requeued

    def add(self, seq: Sequence) -> None:
        self.policy.on_arrival(seq, self)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._queued(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._unqueued(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self._unqueued(seq)
            self._drop_swap(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.register_computed(seq)
        self.block_manager.free(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        if self.block_manager.enable_prefix_caching:  # what the last step computed becomes reusable
            for seq in self.running:
                self.block_manager.register_computed(seq)
        policy = self.policy
        self.running = policy.order(self.running)  # the token budget goes to the first ones first
        if self.swapped:
            self.swapped = deque(policy.order(self.swapped))

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if seq.ends_when_resolved:  # its pending token ends it (async scheduling: engine.py)
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_append(seq, num_new):
                victim = self._pick_victim(scheduled_ids)
                self.preempt(victim, out)
                out.scheduled = [s for s in out.scheduled if s.seq is not victim]
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.append(seq, num_new)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
        self._charge(out.scheduled, out)

        if not out.preempted:
            self._swap_in(out)
            if not self.swapped:
                self._admit_waiting(out, budget)
        return out

    def check(self, seq: Sequence) -> None:
        """Raise what scheduling `seq` raises from its own request's values (its place in the
        policy's orders, its prefix and block counts), changing nothing: after a `schedule()` that
        raised, the engine asks this of each sequence to find the requests to end alone."""
        policy = self.policy
        policy.order([seq])
        policy.victim([seq])
        policy.admission(deque([seq])).peek()
        self.block_manager.match_prefix(seq)
        self.block_manager.num_new_blocks(seq, seq.num_uncomputed_tokens)

    def _swap_in(self, out: SchedulerOutput) -> None:
        """Bring swapped sequences back into fresh device blocks, oldest first, while the headroom
        stays free. They run from the next step, once their copies have landed."""
        if not self.swapped:
            return
        bm = self.block_manager
        horizon = max(SWAP_IN_HORIZON, bm.block_size)
        headroom = sum(bm.num_new_blocks(s, s.num_uncomputed_tokens + horizon) for s in self.running)
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            needed = len(seq.swap_table)
            # with its own headroom (never more than a sequence can hold, so one always fits alone)
            total = max(needed, bm.num_blocks_for(min(seq.num_tokens + horizon, self.config.max_model_len)))
            if total + headroom > bm.num_free_blocks:
                break
            self.swapped.popleft()
            self._unqueued(seq)
            seq.block_table = bm.allocate(needed)
            out.swap_in.extend(zip(seq.swap_table, seq.block_table, strict=True))
            self._drop_swap(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            headroom += total - needed

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting or budget == 0 or len(self.running) >= self.config.max_num_seqs:
            return  # no room: the policy's admission order (a pass over the queue) is not needed
        cursor = self.policy.admission(self.waiting)
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = cursor.peek()
            if seq is None:
                break
            matched, digests = self.block_manager.match_prefix(seq)
            cached = len(matched) * self.block_manager.block_size
            num_new = self._fit(seq.num_uncomputed_tokens - cached, budget)
            if num_new == 0 or not self.block_manager.can_take(matched, num_new):
                break
            cursor.take(seq)
            self._unqueued(seq)
            if matched:
                self.block_manager.take(seq, matched, digests)
                if seq.num_output_tokens == 0:
                    seq.num_cached_tokens = max(seq.num_cached_tokens, cached)
            self._start(seq, num_new, out)
            budget -= num_new

    def _fit(self, num_tokens: int, budget: int) -> int:
        """How many of a sequence's `num_tokens` this step's budget takes: all, a chunk when chunked
        prefill is on, else none."""
        if num_tokens > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(num_tokens, budget)

    def _start(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        """Blocks for `num_new` more tokens, then run `seq` this step."""
        self.block_manager.append(seq, num_new)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, num_new))
        self._charge(out.scheduled[-1:], out)

    def _charge(self, scheduled: list[ScheduledSeq], out: SchedulerOutput) -> None:
        """Count the tokens these serve for their tenants: prompt positions computed for the first
        time, and the tokens they sample (the policy is charged once per tenant)."""
        charged: dict[str, list[int]] = {}
        for s in scheduled:
            seq = s.seq
            num_prompt = 0
            if seq.num_prompt_tokens_served < seq.num_prompt_tokens:
                start = seq.num_computed_tokens
                prompt_end = min(start + s.num_new_tokens, seq.num_prompt_tokens)
                num_prompt = max(0, prompt_end - max(start, seq.num_prompt_tokens_served))
                seq.num_prompt_tokens_served = max(seq.num_prompt_tokens_served, prompt_end)
            tenant = seq.request.tenant
            counts = charged.get(tenant)
            if counts is None:
                counts = charged[tenant] = [0, 0]
            counts[0] += num_prompt
            counts[1] += s.samples
        for tenant, (num_prompt, num_generated) in charged.items():
            served = out.served_tokens.setdefault(tenant, [0, 0])
            served[0] += num_prompt
            served[1] += num_generated
            self.policy.charge(tenant, num_prompt, num_generated)

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence:
        """The running sequence that comes last in the policy's order (the newest under fcfs), not
        yet scheduled this step if there is one."""
        candidates = [s for s in self.running if s.seq_id not in scheduled_ids] or self.running
        return self.policy.victim(candidates)

    def preempt(self, seq: Sequence, out: SchedulerOutput | None = None) -> None:
        """Take a running sequence off the device: swapped to host memory when the mode is swap,
        `out` is given (its copies must run before the step) and the swap space has room; else
        recomputed (its KV dropped, queued first for re-prefill)."""
        self.running.remove(seq)
        self.block_manager.register_computed(seq)
        table = seq.block_table
        if (out is not None and self.config.preemption_mode == "swap" and seq.num_computed_tokens > 0
                and self.swap_pool.can_allocate(len(table))):
            seq.swap_table = self.swap_pool.allocate(len(table))
            out.swap_out.extend(zip(table, seq.swap_table, strict=True))
            out.num_swapped_out += 1
            self.num_swapped_out += 1
            self.block_manager.free(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.block_manager.free(seq)
            self._requeue(seq)
        self._queued(seq)
        if out is not None:
            out.preempted.append(seq)
        self.num_preemptions += 1

    def _queued(self, seq: Sequence) -> None:
        """`seq` joined the waiting or swapped sequences (a move between the two changes nothing)."""
        request = seq.request
        count = self._num_queued.get(request, 0)
        if count == 0:
            self.backlog[request.tenant] = self.backlog.get(request.tenant, 0) + 1
        self._num_queued[request] = count + 1

    def _unqueued(self, seq: Sequence) -> None:
        """`seq` left the waiting or swapped sequences."""
        request = seq.request
        count = self._num_queued.pop(request) - 1
        if count:
            self._num_queued[request] = count
            return
        remaining = self.backlog.pop(request.tenant) - 1
        if remaining:
            self.backlog[request.tenant] = remaining

    def _requeue(self, seq: Sequence) -> None:
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _drop_swap(self, seq: Sequence) -> None:
        self.swap_pool.free(seq.swap_table)
        seq.swap_table = []

