"""Request isolation, in the engine core process (`LLM`: the caller's process).

A request whose own values make a step raise ends alone: when scheduling, building the step's
inputs or sampling raises, each request is probed alone (`fail_culprits`), the ones that still
raise are ended through `fail` (`LLMEngine._fail_request`: finish reason "error") and the step
goes on without them. Nothing is probed while a step succeeds, and an error that no request
explains propagates (it ends the core), as does what breaks the engine itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvpilot.runtime.engine.step_inputs import build_step_inputs, rewind
from kvpilot.runtime.errors import RowsFailedError
from kvpilot.runtime.executor.inputs import StepInputs
from kvpilot.runtime.executor.model_runner import ModelRunner
from kvpilot.runtime.executor.sampler import DevicePromptLogprobs, DeviceSample
from kvpilot.runtime.sched.scheduler import Scheduler, SchedulerOutput
from kvpilot.runtime.sched.sequence import Request, Sequence

# ends a request alone with this message; its sequences' ids join the engine's finished ids
Fail = Callable[[Request, str], None]


def schedule(scheduler: Scheduler, requests: Iterable[Request], fail: Fail) -> SchedulerOutput:
    """`scheduler.schedule()`. If it raises, the `requests` whose own values make scheduling raise
    (`Scheduler.check`) end alone and the step is scheduled again without them; an error that no
    request explains ends the core, as before."""
    try:
        return scheduler.schedule()
    except Exception:
        seqs = [seq for request in requests for seq in request.seqs if not seq.is_finished]
        if not fail_culprits(seqs, scheduler.check, fail):
            raise
    return scheduler.schedule()


def build_inputs(sched: SchedulerOutput, block_size: int, eos_token_ids: frozenset[int],
                 finished_seq_ids: list[int], fail: Fail) -> StepInputs | None:
    """The step's inputs, which take (and empty) `finished_seq_ids`; as `schedule`, a scheduled
    sequence whose own values make building them raise (each is tried alone) ends its request, and
    the rest are built again. None if no sequence is left (`finished_seq_ids` then stay)."""
    try:
        inputs = build_step_inputs(sched.scheduled, block_size, eos_token_ids, finished_seq_ids[:])
    except Exception:
        by_seq = {s.seq: s for s in sched.scheduled}

        def alone(seq: Sequence) -> None:
            rewind(build_step_inputs([by_seq[seq]], block_size, eos_token_ids, []), [by_seq[seq]])

        if not fail_culprits(list(by_seq), alone, fail):
            raise
        sched.scheduled = [s for s in sched.scheduled if s.seq.request.error is None]
        if not sched.scheduled:
            return None
        inputs = build_step_inputs(sched.scheduled, block_size, eos_token_ids, finished_seq_ids[:])
    finished_seq_ids.clear()
    return inputs


def queue_on_device(runner: ModelRunner, sched: SchedulerOutput, inputs: StepInputs, eos_token_ids: frozenset[int],
                    finished_seq_ids: list[int], fail: Fail) -> tuple[
                        tuple[DeviceSample | None, DevicePromptLogprobs | None], StepInputs] | None:
    """`runner.launch(inputs)` and the inputs it ran. A request whose sampling fails ends alone
    (`RowsFailedError`): the step is queued again without it, its inputs taking (and emptying)
    `finished_seq_ids`; None if no request is left."""
    while True:
        try:
            return runner.launch(inputs), inputs
        except RowsFailedError as failed:
            rewind(inputs, sched.scheduled)
            seqs = {s.seq.seq_id: s.seq for s in sched.scheduled}
            for seq_id, message in failed.errors.items():
                fail(seqs[seq_id].request, f"sampling failed: {message}")
            sched.scheduled = [s for s in sched.scheduled if s.seq.request.error is None]
            if not sched.scheduled:
                return None
            inputs = build_step_inputs(sched.scheduled, runner.block_size, eos_token_ids,
                                       inputs.finished_seq_ids + finished_seq_ids)
            finished_seq_ids.clear()


def fail_culprits(seqs: list[Sequence], trial: Callable[[Sequence], None], fail: Fail) -> bool:
    """End alone each request one of whose `seqs` makes `trial` raise; whether any did."""
    failed = False
    for seq in seqs:
        if seq.request.error is not None:
            continue
        try:
            trial(seq)
        except Exception as error:  # noqa: BLE001 - its own values: it alone fails
            fail(seq.request, f"scheduling failed: {type(error).__name__}: {error}")
            failed = True
    return failed
