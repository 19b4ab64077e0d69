"""A live block-size change: the KV cache re-cut in place under running sequences.

`change_block_size` plans the re-cut of the device cache and of the swap space (relayout.py),
has the runner copy the blocks it keeps (on a GPU the copies run while the host rebuilds its
bookkeeping), rewrites the sequences' block tables and rebuilds the block manager and the swap
pool; only sequences the new cut cannot hold are recomputed, the fewest possible. `RelayoutReport`
says what it cost (`LLMEngine.last_relayout`; `POST /admin/config` returns it).
`warm_up_block_switches` runs the same path once per allowed size at start.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from kvpilot.runtime.executor import kv_cache
from kvpilot.runtime.executor.model_runner import ModelRunner
from kvpilot.runtime.sched.block_manager import BlockManager
from kvpilot.runtime.sched.relayout import gc_paused, plan_relayout
from kvpilot.runtime.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class RelayoutReport:
    """What a live block-size change did (`LLMEngine.last_relayout`; the admin API returns it)."""

    old_block_size: int
    new_block_size: int
    pause_ms: float  # no step ran meanwhile: planning, copies and bookkeeping
    bytes_moved: int  # written in device memory
    swap_bytes_moved: int  # written in the host swap space
    # where the pause went (ms): planning both re-cuts; waiting for swap copies in flight; the device
    # cache's copies (on CUDA their device time, which overlaps swap_ms); the host swap space's
    # re-cut; tables, block manager, prefix cache and swap pool rebuilt
    plan_ms: float
    wait_ms: float
    copy_ms: float
    swap_ms: float
    rebuild_ms: float
    num_blocks: int
    num_running_kept: int  # running sequences whose KV was re-laid
    num_swapped_kept: int  # swapped sequences whose host KV was re-laid
    preempted: list[str]  # request ids of running sequences recomputed: the new cut could not hold them
    swapped_recomputed: list[str]  # request ids of swapped sequences that no longer fit the swap space

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def change_block_size(sched: Scheduler, block_manager: BlockManager, runner: ModelRunner,
                      block_size: int) -> RelayoutReport:
    """Re-cut the KV cache into blocks of `block_size` in place, keeping the KV of running
    sequences (on the device) and swapped ones (in the swap space); logs and returns what it cost."""
    report = relayout(sched, block_manager, runner, block_size)
    logger.info("block size %d -> %d in %.1f ms (plan %.1f, wait %.1f, copy %.1f, swap %.1f, rebuild %.1f): "
                "%d running and %d swapped sequences kept, %.1f MiB moved, %d recomputed",
                report.old_block_size, block_size, report.pause_ms, report.plan_ms, report.wait_ms,
                report.copy_ms, report.swap_ms, report.rebuild_ms, report.num_running_kept,
                report.num_swapped_kept, (report.bytes_moved + report.swap_bytes_moved) / (1 << 20),
                len(report.preempted) + len(report.swapped_recomputed))
    return report


def relayout(sched: Scheduler, block_manager: BlockManager, runner: ModelRunner, block_size: int,
             unheld: list[tuple[list[int], int]] | None = None) -> RelayoutReport:
    """`change_block_size`'s work. `unheld`: more (block table, tokens) to re-lay, of blocks that
    no sequence holds (the start-up warm-up's), planned and copied as a sequence's are."""
    started = time.perf_counter()
    old = runner.layout
    new = old.with_block_size(block_size)
    batch = kv_cache.max_batch(old, old.block_size, block_size)
    running, swapped = list(sched.running), list(sched.swapped)
    plan = plan_relayout(old.block_size, block_size, old.num_blocks, new.num_blocks,
                         [(s.block_table, s.num_computed_tokens) for s in running] + (unheld or []), batch)
    swap_plan = plan_relayout(old.block_size, block_size, old.num_swap_blocks, new.num_swap_blocks,
                              [(s.swap_table, s.num_computed_tokens) for s in swapped], batch)
    planned = time.perf_counter()
    tables = plan.tables[:len(running)]
    dropped = [seq for seq, table in zip(running, tables, strict=True) if table is None]
    for seq in dropped:
        sched.preempt(seq)  # recompute: its blocks go back before the new cut is counted
    # the host re-cut keeps a swapped sequence's tokens wherever its new table says (swap.py)
    swap_moves = [(s.swap_table[:-(-s.num_computed_tokens // old.block_size)], list(t), s.num_computed_tokens)
                  for s, t in zip(swapped, swap_plan.tables, strict=True) if t is not None]
    cost = runner.relayout(block_size, plan, swap_moves)  # on a GPU the copies run meanwhile
    copied = time.perf_counter()
    for seq, table in zip(running, tables, strict=True):
        if table is not None:
            seq.block_table = table
    block_manager.reconfigure(new.num_blocks, block_size, sched.running)
    requeued = sched.reconfigure(num_swap_blocks=new.num_swap_blocks, swap_tables=list(swap_plan.tables))
    rebuilt = time.perf_counter()
    cost.finish()
    done = time.perf_counter()
    return RelayoutReport(
        old_block_size=old.block_size, new_block_size=block_size,
        pause_ms=(done - started) * 1e3, bytes_moved=cost.bytes_moved, swap_bytes_moved=cost.swap_bytes_moved,
        plan_ms=(planned - started) * 1e3, wait_ms=cost.wait_ms, copy_ms=cost.copy_ms, swap_ms=cost.swap_ms,
        rebuild_ms=(rebuilt - copied) * 1e3,
        num_blocks=new.num_blocks, num_running_kept=len(running) - len(dropped),
        num_swapped_kept=len(swapped) - len(requeued),
        preempted=[s.request.request_id for s in dropped],
        swapped_recomputed=[s.request.request_id for s in requeued])


def warm_up_block_switches(sched: Scheduler, block_manager: BlockManager, runner: ModelRunner) -> None:
    """At start, switch through every allowed block size and back by the live path (planner,
    device copies, views, graph lookup, block manager and swap pool rebuilds), splits and merges
    both, so that what a process pays on its first switch (CUDA modules loaded on the copy
    kernels' first launch, the copies' first temporary memory: benchmarks/history/2026-12-04.md,
    "Every ordered pair") is paid before any request waits on it. No sequence exists yet: each
    switch re-lays a few blocks that none holds, from block 1 so that a merge's groups are out of
    place."""
    started = time.perf_counter()
    first = runner.block_size
    walk = [size for size in runner.allowed_block_sizes if size != first] + [first]
    with gc_paused():
        for size in walk:
            old = runner.block_size
            count = min(2 * max(old, size) // min(old, size), runner.num_blocks - 1)
            relayout(sched, block_manager, runner, size, [(list(range(1, 1 + count)), count * old)] if count > 0 else [])
    logger.info("block-size switches %s warmed up in %.0f ms", " -> ".join(map(str, [first, *walk])),
                (time.perf_counter() - started) * 1e3)
