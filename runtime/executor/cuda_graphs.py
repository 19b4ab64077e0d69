"""CUDA graphs for decode steps.

On a GPU a decode step is bound by the host: every layer launches its norms, projections, rotary,
cache write and attention one by one from Python, and at small batches that takes longer than the
memory traffic it drives. A graph records those launches once per batch size and replays them
with one call. Decode steps have one token per sequence, so a step of n sequences is fully
described by n: it runs the graph of the smallest captured size >= n, on static input buffers
that `run` fills each step (through batch.py's `to_tensors`, which pads rows past n so that they
never touch a real sequence's cache).

The graphs record the ops' `for_graphs()`: on Hopper GPUs their paged attention takes the TMA
decode kernel, whose launch costs more host time than the device time it saves, which a replay
does not pay (kernels/paged_attention/tma_decode.py). It does so where the context is not split:
batches whose (sequence, KV head) programs fill the chip; smaller ones split each context over
more programs with the pointer kernel.

Before the engine is ready, graphs are captured for the block size it starts with (after the KV
cache is allocated, largest first, into one shared memory pool); the other allowed block sizes'
graphs (`GraphsBySize`) are captured after it is ready, one batch size at a time between steps
(`capture_next`, driven by engine/warm_up.py), or all at once when a live change reaches a size
whose graphs are not there yet. A live block-size change re-cuts the same cache memory
(kv_cache.py), so each size's graphs stay valid and are reused on every later switch to that size.
Prefill and mixed steps, batches larger than the largest size, and `--enforce-eager` run eagerly.

CI has no GPU: tests/runtime/test_gpu_engine.py checks the graphs against HF and against eager mode
on a GPU (`benchmarks/run_on_gpu.sh`); `benchmarks/bench_engine_gpu.py` times a decode step with
and without them in one engine (benchmarks/RESULTS.md, "Engine decode step").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvpilot.kernels.ops import Ops
from kvpilot.runtime.executor.batch import fill_pending, to_tensors
from kvpilot.runtime.executor.inputs import StepInputs
from kvpilot.runtime.executor.models.llama import AttentionMetadata

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 up to max_num_seqs (capped at
    512), and max_num_seqs itself, so any decode batch pads by fewer than 8 rows."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return sorted(sizes)


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """Captured decode steps over static inputs. `forward(input_ids, positions, meta)` is the
    model's forward pass with the runner's caches, rotary table and ops bound in."""

    def __init__(self, forward: Forward, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.forward = forward
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token each
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._to_capture = list(reversed(self.sizes))  # largest first: the smaller ones fit in its memory
        self.capture_seconds = 0.0
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @property
    def complete(self) -> bool:
        """Every batch size is captured (only then may a step replay them: `stage` picks among all)."""
        return not self._to_capture

    def capture_next(self, pool: _POOL_HANDLE) -> None:
        """Capture the largest batch size not captured yet (pool: shared by every graph, as they
        replay one at a time)."""
        start = time.perf_counter()
        self._capture(self._to_capture.pop(0), pool)
        self.capture_seconds += time.perf_counter() - start

    def capture_all(self, pool: _POOL_HANDLE) -> None:
        while not self.complete:
            self.capture_next(pool)
        logger.info("captured CUDA graphs for %d decode batch sizes (1..%d) in %.2f s",
                    len(self.sizes), self.max_batch, self.capture_seconds)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                                 seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
                                 max_query_len=1)

    def _capture(self, size: int, pool: _POOL_HANDLE) -> None:
        args = (self.input_ids[:size], self.positions[:size], self._meta(size))
        # run once outside the graph first: Triton compiles and cuBLAS picks its kernels here, and
        # neither may happen while capturing (the static inputs are all padding: nothing is written)
        side = torch.cuda.Stream(self.input_ids.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.forward(*args)
        self._graphs[size] = (graph, out)

    def stage(self, inputs: StepInputs) -> int | None:
        """Copy a decode batch (one token per sequence) into the static inputs, padded to the
        smallest captured size that holds it (batch.py); that size, or None when none does (more
        sequences than the largest size, or block tables wider than max_model_len allows)."""
        size = next((s for s in self.sizes if s >= inputs.num_seqs), None)
        width = max(len(t) for t in inputs.block_tables)
        if size is None or width > self.block_tables.shape[1]:
            return None
        # padding goes in with the real rows: stale slots in the static buffers would write the
        # padding's K/V into some sequence's cache
        # pinned on a GPU: copies that do not wait for the step the device still runs
        input_ids, positions, meta = to_tensors(inputs, "cpu", pad_to=size, pinned=self.input_ids.is_cuda)
        self.input_ids[:size].copy_(input_ids, non_blocking=True)
        self.positions[:size].copy_(positions, non_blocking=True)
        self.slot_mapping[:size].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:size].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:size, :width].copy_(meta.block_tables, non_blocking=True)
        return size

    def run(self, inputs: StepInputs, sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """Replay the decode step of `inputs` (its pending tokens taken from the previous step's
        `sampled` tokens: batch.py's `fill_pending`); the sequences' hidden states (num_seqs,
        hidden), valid until the next replay, or None when no graph holds the batch (run it eagerly)."""
        size = self.stage(inputs)
        if size is None:
            return None
        fill_pending(self.input_ids, inputs, sampled)
        graph, out = self._graphs[size]
        graph.replay()
        self.replays += 1
        return out[:inputs.num_seqs]


class GraphsBySize:
    """Each block size's decode graphs, captured into one memory pool (one size runs at a time, so
    their intermediates can share it). A size's graphs are handed out only once complete."""

    def __init__(self) -> None:
        self._by_size: dict[int, DecodeGraphs] = {}
        self._pool: _POOL_HANDLE | None = None

    def get(self, block_size: int) -> DecodeGraphs | None:
        return self._by_size.get(block_size)

    @property
    def pool(self) -> _POOL_HANDLE:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def capture(self, block_size: int, graphs: DecodeGraphs) -> None:
        """Capture what `graphs` still lacks, now, and hand them out."""
        graphs.capture_all(self.pool)
        self.add(block_size, graphs)

    def add(self, block_size: int, graphs: DecodeGraphs) -> None:
        if not graphs.complete:
            raise ValueError(f"block size {block_size}: some of its decode graphs are not captured yet")
        self._by_size[block_size] = graphs

    @property
    def block_sizes(self) -> list[int]:
        return sorted(self._by_size)


def model_forward(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                  rope: torch.Tensor, ops: Ops) -> Forward:
    block_size = kv_caches[0][0].shape[1]  # (num_blocks, block_size, num_kv_heads, head_dim)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model(input_ids, kv_caches, ops.plan(meta, positions, rope, block_size), ops)
    return forward
