"""Logprob entries, `{token id: Logprob}`, as outputs carry them: built from what the sampler
hands back for a row (`RowLogprobs`, executor/inputs.py; engine.py) or from the engine core's
messages (`(token id, logprob, rank)` triples; output_processor.py). A token's text comes from
`decode`, which gives None where nothing detokenizes (the engine core: the API process
decodes). No torch."""

from __future__ import annotations

from collections.abc import Callable

from kvpilot.runtime.executor.inputs import RowLogprobs
from kvpilot.runtime.outputs import Logprob
from kvpilot.runtime.sched.sequence import Request, Sequence

Decode = Callable[[int], str | None]


def no_text(_token_id: int) -> None:
    return None


def from_row(token: int, row: RowLogprobs, decode: Decode) -> dict[int, Logprob]:
    """{token: its Logprob, then the top alternatives'} (the token keeps its own rank)."""
    value, rank, top = row
    entry = {token: Logprob(value, rank, decode(token))}
    for r, (tid, tlp) in enumerate(top, start=1):
        entry.setdefault(tid, Logprob(tlp, r, decode(tid)))
    return entry


def from_message(triples: list[tuple[int, float, int]], decode: Decode) -> dict[int, Logprob]:
    return {tid: Logprob(value, rank, decode(tid)) for tid, value, rank in triples}


def record_sample(seq: Sequence, token: int, row: RowLogprobs, decode: Decode) -> None:
    seq.logprobs.append(from_row(token, row, decode))
    seq.cumulative_logprob += row[0]


def record_prompt(rows: list[RowLogprobs], owners: list[tuple[Request, int]],
                  is_live: Callable[[Request], bool], decode: Decode) -> None:
    """Each owner's rows, in order, as its next prompt positions' entries; an owner that is no
    longer live (aborted while its step ran) drops its rows."""
    at = 0
    for request, count in owners:
        entries = request.prompt_logprobs
        if entries is not None and is_live(request):
            for row in rows[at:at + count]:
                entries.append(from_row(request.prompt_token_ids[len(entries)], row, decode))
        at += count
