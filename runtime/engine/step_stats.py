"""What one `LLMEngine.step()` did, for metrics and logs, in the engine core process (`LLM`: the
caller's process); the core sends it to the API process as a `StepStatsMsg`."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from kvpilot.runtime.engine.postprocess import Resolved
from kvpilot.runtime.executor.model_runner import ModelRunner
from kvpilot.runtime.sched.scheduler import SchedulerOutput


@dataclass
class StepStats:
    """What one `step()` call did, for metrics and logs: what it scheduled (tokens, preemptions,
    copies) and the tokens it delivered (with async scheduling, the step before's)."""

    duration_s: float
    num_batched_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    num_swapped_out: int = 0  # of the preemptions, those swapped to host memory
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    # seconds the copies took on the device, counted when they complete (they overlap the steps)
    swap_out_seconds: float = 0.0
    swap_in_seconds: float = 0.0
    served_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # tenant -> [prompt, generated]


def step_stats(sched: SchedulerOutput, done: Resolved, runner: ModelRunner, start: float) -> StepStats | None:
    """What the step that started at `start` (`time.perf_counter()`) did; None for a step that did
    nothing."""
    if (sched.is_empty and not sched.preempted and not sched.swap_in and not done.num_generation_tokens
            and not done.outputs):
        return None
    block_bytes = runner.bytes_per_block
    swap = runner.take_swap_stats()
    return StepStats(
        duration_s=time.perf_counter() - start,
        num_batched_tokens=sched.num_batched_tokens,
        num_prompt_tokens=done.num_prompt_tokens,
        num_generation_tokens=done.num_generation_tokens,
        num_preemptions=len(sched.preempted),
        num_swapped_out=sched.num_swapped_out,
        swap_out_bytes=len(sched.swap_out) * block_bytes,
        swap_in_bytes=len(sched.swap_in) * block_bytes,
        swap_out_seconds=swap.seconds_out,
        swap_in_seconds=swap.seconds_in,
        served_tokens=sched.served_tokens,
    )
