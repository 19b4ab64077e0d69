"""What the engine hands the executor each step: plain lists, no tensors, no scheduler objects.

The engine lays the scheduled sequences' new tokens back to back (varlen, no padding). For the
i-th sequence with `c` tokens already in the KV cache and `n` new ones, rows
`query_start_loc[i]:query_start_loc[i + 1]` hold its tokens c..c+n-1, at positions c..c+n-1,
written to the cache slots `slot_mapping` lists (block `block_tables[i][p // block_size]`,
offset `p % block_size`); attention sees its whole context of `seq_lens[i]` = c+n tokens. A
sequence with one new token is a *decode*, one with more a *prefill* (or a chunk of one); only
sequences whose chunk reaches their last token produce logits (`logits_rows`) and sample (their
`sampling_rows`, in the same order).

A request that asks for prompt logprobs also has logits computed at the prompt positions its
chunk covers (`prompt_logprob_rows`), each scored against the prompt token that follows
(`prompt_logprob_targets`), with the top `prompt_logprob_k`; `prompt_logprob_owners` says whose
they are, in order: (request id, how many rows).

With async scheduling a token may be *pending*: sampled by the previous step, still on the
device. Its row of `input_ids` holds a placeholder (-1) and is listed in `pending_rows`, beside
the previous step's sample row that holds the token (`pending_samples`); the runner fills it on the
device before the forward pass.

Everything here is picklable: under tensor parallelism rank 0 broadcasts the model half of it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvpilot.runtime.sampling_params import SamplingParams

# what the executor hands back per logprob row: (a token's logprob, its rank (1 = most likely),
# the top alternatives [(token id, logprob)])
RowLogprobs = tuple[float, int, list[tuple[int, float]]]


@dataclass(slots=True)  # not frozen: cheaper to build, and the engine builds one per sample per step
class SamplingRow:
    """One sequence that samples this step (read, never changed, by the executor)."""

    seq_id: int  # the executor keeps a seeded sequence's random generator under this id
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (for penalties)
    num_prompt_tokens: int
    eos_token_ids: frozenset[int]
    seed: int | None = None  # this sequence's own seed (the request's seed + its sample index)


@dataclass
class StepInputs:
    input_ids: list[int]  # (num_tokens,)
    positions: list[int]  # (num_tokens,)
    slot_mapping: list[int]  # (num_tokens,) cache slot of each new token
    block_tables: list[list[int]]  # per sequence, its blocks in order (ragged: not padded)
    seq_lens: list[int]  # per sequence, its context length once this step's tokens are in
    query_start_loc: list[int]  # (num_seqs + 1,) where each sequence's rows start
    logits_rows: list[int]  # rows whose logits are sampled: the last row of each sampling sequence
    sampling_rows: list[SamplingRow] = field(default_factory=list)
    # sequences that finished or were aborted since the last step: their generators are dropped
    finished_seq_ids: list[int] = field(default_factory=list)
    pending_rows: list[int] = field(default_factory=list)  # rows whose token the previous step sampled
    pending_samples: list[int] = field(default_factory=list)  # each one's row in that step's samples
    prompt_logprob_rows: list[int] = field(default_factory=list)
    prompt_logprob_targets: list[int] = field(default_factory=list)  # the prompt token each row predicts
    prompt_logprob_k: int = 0  # top alternatives per row: the widest ask of the step
    prompt_logprob_owners: list[tuple[str, int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        if self.is_decode_only:
            return 1
        return max(b - a for a, b in itertools.pairwise(self.query_start_loc))

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes exactly one token (the steps decode CUDA graphs replay)."""
        return len(self.input_ids) == self.num_seqs
