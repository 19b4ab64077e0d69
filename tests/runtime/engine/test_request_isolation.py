"""A request whose own values make scheduling, sampling or post-processing raise ends alone (finish
reason "error", `RequestOutput.error` saying why), and the requests beside it in the same steps
finish as they would have without it — seeded ones token for token, prompt logprobs included."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.sched.sequence import Request

PROMPT = "Tell me a story about a dragon."


def _seeded() -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=8, seed=3, prompt_logprobs=1)


def _run_to_end(llm: LLM, bad: Callable[[Request], None], priority: int = 0) -> dict[str, RequestOutput]:
    engine = llm.engine
    engine.add_request("good", PROMPT, _seeded())
    bad(engine.add_request("bad", PROMPT, SamplingParams(temperature=1.0, max_tokens=8, seed=1, ignore_eos=True),
                           priority=priority))
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    return finals


def _break_seed(request: Request) -> None:
    request.params.seed = 2**64  # past any generator, as a value the checks at the door missed


def _break_stop_token_ids(request: Request) -> None:
    request.params.stop_token_ids = 5  # type: ignore[assignment]  # not a list: the stop check raises


def _break_seed_type(request: Request) -> None:
    request.params.seed = "1"  # type: ignore[assignment]  # its sampling row (seed + index) raises while the step is built


def _assert_ended_alone(llm: LLM, finals: dict[str, RequestOutput], where: str, alone: RequestOutput) -> None:
    bad = finals["bad"]
    assert bad.error is not None and where in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    good = finals["good"]
    assert good.error is None
    assert good.outputs[0].token_ids == alone.outputs[0].token_ids
    assert good.prompt_logprobs == alone.prompt_logprobs
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests
    assert llm.generate(PROMPT, _seeded())[0].outputs[0].token_ids == alone.outputs[0].token_ids  # it serves on


@pytest.mark.parametrize(("break_it", "where"), [(_break_seed, "sampling failed: ValueError: Overflow"),
                                                 (_break_stop_token_ids, "postprocessing failed: TypeError"),
                                                 (_break_seed_type, "scheduling failed: TypeError")])
def test_a_request_that_breaks_its_step_ends_alone(smol_llm: LLM, break_it: Callable[[Request], None],
                                                   where: str) -> None:
    alone = smol_llm.generate(PROMPT, _seeded())[0]
    _assert_ended_alone(smol_llm, _run_to_end(smol_llm, break_it), where, alone)


def test_a_request_that_breaks_the_schedulers_order_ends_alone(smol_llm: LLM) -> None:
    """The engine's door takes any integer priority; one past float's range breaks the priority
    policy's sort key (arrival time + priority * aging) when the scheduler orders the queue."""
    alone = smol_llm.generate(PROMPT, _seeded())[0]
    engine = smol_llm.engine
    engine.update_config({"scheduler_policy": "priority"})
    try:
        finals = _run_to_end(smol_llm, lambda _: None, priority=10**400)
        _assert_ended_alone(smol_llm, finals, "scheduling failed: OverflowError", alone)
    finally:
        engine.update_config({"scheduler_policy": "fcfs"})
