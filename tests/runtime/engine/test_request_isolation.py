"""A request whose own values make sampling or post-processing raise ends alone (finish reason
"error", `RequestOutput.error` saying why), and the requests beside it in the same steps finish as
they would have without it — seeded ones token for token."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.outputs import RequestOutput
from kvpilot.runtime.sched.sequence import Request

PROMPT = "Tell me a story about a dragon."


def _seeded() -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=8, seed=3)


def _run_to_end(llm: LLM, bad: Callable[[Request], None]) -> dict[str, RequestOutput]:
    engine = llm.engine
    engine.add_request("good", PROMPT, _seeded())
    bad(engine.add_request("bad", PROMPT, SamplingParams(temperature=1.0, max_tokens=8, seed=1, ignore_eos=True)))
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    return finals


def _break_seed(request: Request) -> None:
    request.params.seed = 2**64  # past any generator, as a value the checks at the door missed


def _break_stop_token_ids(request: Request) -> None:
    request.params.stop_token_ids = 5  # type: ignore[assignment]  # not a list: the stop check raises


@pytest.mark.parametrize(("break_it", "where"), [(_break_seed, "sampling failed: ValueError: Overflow"),
                                                 (_break_stop_token_ids, "postprocessing failed: TypeError")])
def test_a_request_that_breaks_its_step_ends_alone(smol_llm: LLM, break_it: Callable[[Request], None],
                                                   where: str) -> None:
    alone = smol_llm.generate(PROMPT, _seeded())[0].outputs[0].token_ids
    finals = _run_to_end(smol_llm, break_it)
    bad = finals["bad"]
    assert bad.error is not None and where in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    assert finals["good"].outputs[0].token_ids == alone and finals["good"].error is None
    bm = smol_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not smol_llm.engine.requests
    assert smol_llm.generate(PROMPT, _seeded())[0].outputs[0].token_ids == alone  # it serves on
