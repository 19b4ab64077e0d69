"""The only part of the engine that touches tensors: owns the model and the KV cache, turns a
scheduled batch into input tensors, runs the forward pass and samples.

Batch layout (varlen, no padding): the scheduled sequences' new tokens are laid back to back.
For sequence i with `c` tokens already computed and `n` new ones, rows qsl[i]:qsl[i]+n of the
batch hold its tokens c..c+n-1, at positions c..c+n-1, written to slots taken from its block
table; attention sees its whole context of c+n tokens. Only sequences whose chunk reaches their
last token produce logits.

Under tensor parallelism every rank has a runner over its slice of the model and KV cache; rank
0's `execute` broadcasts the step's inputs and the other ranks' `follow` loop runs them.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from kvpilot.kernels import ops as kernel_ops
from kvpilot.kernels.reference import kv_cache_empty
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.executor.cpu_linear import pack_linears
from kvpilot.runtime.executor.cuda_graphs import DecodeGraphs, model_forward
from kvpilot.runtime.executor.loader import load_model, resolve_dtype
from kvpilot.runtime.executor.models.llama import AttentionMetadata, cos_sin_cache
from kvpilot.runtime.executor.parallel import TPInfo
from kvpilot.runtime.executor.sampler import SampleResult, SamplingRow, sample
from kvpilot.runtime.executor.swap import MAX_STAGING_BYTES, SwapSpace, SwapStats
from kvpilot.runtime.engine.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass
class StepInputs:
    """One step's model inputs as plain lists: cheap to broadcast to the other ranks."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]
    query_start_loc: list[int]
    logits_rows: list[int]


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPInfo | None = None) -> None:
        self.config = config
        self.tp = tp or TPInfo()
        device = config.device.device
        self.device = torch.device(f"cuda:{self.tp.rank}" if device == "cuda" else device)
        self.dtype = resolve_dtype(config.model.dtype, device)
        self.model, self.model_config = load_model(config.model, str(self.device), self.tp)
        # CPU: weights packed once for oneDNN (decode steps are bound by reading them; cpu_linear.py)
        pack_linears(self.model, config.scheduler.max_num_seqs)
        self.num_kv_heads = self.model.layers[0].num_kv_heads  # this rank's share
        self.ops = kernel_ops.select(self.device)
        self.rope = cos_sin_cache(self.model_config, config.model.max_model_len, self.device)
        self.block_size = config.cache.block_size
        self.graphs: DecodeGraphs | None = None  # captured once the KV cache exists
        self.swap_space: SwapSpace | None = None  # made once the KV cache exists
        self.num_blocks = self.tp.min_int(self._num_kv_blocks(), self.device)  # ranks must agree
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.swap_space = SwapSpace(self.kv_caches, self._swap_bytes)
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        """CUDA graphs for decode steps (cuda_graphs.py) on CUDA, unless --enforce-eager. Under
        tensor parallelism the steps stay eager: graphs over NCCL collectives have not been run
        here (no machine with several GPUs was lent)."""
        self.graphs = None
        if self.device.type != "cuda" or self.config.device.enforce_eager or self.tp.size > 1:
            return
        max_blocks = -(-self.config.model.max_model_len // self.block_size)
        forward = model_forward(self.model, self.kv_caches, self.rope, self.ops.for_graphs())
        graphs = DecodeGraphs(forward, self.config.scheduler.max_num_seqs, max_blocks, self.device)
        with torch.inference_mode():
            graphs.capture_all()
        self.graphs = graphs

    @property
    def _swap_bytes(self) -> int:
        """Host memory of the swap space (--swap-space GiB; per rank under tensor parallelism)."""
        return int(self.config.cache.swap_space_gib * GiB)

    @property
    def num_swap_blocks(self) -> int:
        return self._swap_bytes // self.bytes_per_block

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        per_token = 2 * cfg.num_layers * self.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        elif self.device.type == "cuda":
            num_blocks = self._profile_cuda_blocks()
        else:
            num_blocks = int(cache.cpu_kv_cache_space_gib * GiB) // self.bytes_per_block
        max_len = self.config.model.max_model_len
        if num_blocks * self.block_size < max_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {self.block_size} = {num_blocks * self.block_size} tokens, "
                f"fewer than max_model_len ({max_len}): lower --max-model-len or give the cache more memory"
            )
        return num_blocks

    def _profile_cuda_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization of the card after a worst-case forward pass."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        self._forward_probe(n)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        _, total = torch.cuda.mem_get_info()
        staging = min(self._swap_bytes, MAX_STAGING_BYTES)  # the swap space's device buffer
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - staging
        return max(0, budget // self.bytes_per_block)

    def _forward_probe(self, num_tokens: int) -> None:
        """One prefill of `num_tokens` tokens over a throwaway one-sequence cache."""
        blocks = -(-num_tokens // self.block_size)
        self.kv_caches = self._allocate_kv_cache(blocks)
        probe = StepInputs(input_ids=[0] * num_tokens, positions=list(range(num_tokens)),
                           slot_mapping=list(range(num_tokens)), block_tables=[list(range(blocks))],
                           seq_lens=[num_tokens], query_start_loc=[0, num_tokens], logits_rows=[num_tokens - 1])
        with torch.inference_mode():
            self._run(probe)
        del self.kv_caches

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model_config
        # head-major on the GPU: the decode kernel streams each (block, KV head) as one run
        shape = dict(num_blocks=num_blocks, block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                     head_dim=cfg.head_dim, head_major=self.device.type == "cuda", dtype=self.dtype,
                     device=self.device)
        return [(kv_cache_empty(**shape), kv_cache_empty(**shape)) for _ in range(cfg.num_layers)]

    def resize_kv_cache(self, block_size: int) -> None:
        """Re-cut the same KV memory into blocks of `block_size` (the cache's contents are lost:
        callers preempt every running sequence first)."""
        if self.tp.size > 1 and self.tp.rank == 0:
            self.tp.broadcast(("resize", block_size))
        total_bytes = self.num_blocks * self.bytes_per_block
        if self.swap_space is not None:
            self.swap_space.synchronize()  # copies in flight still read the old cache
        self.kv_caches = []
        self.graphs = None  # they point into the old cache
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.block_size = block_size
        self.num_blocks = total_bytes // self.bytes_per_block
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        if self.swap_space is not None:
            self.swap_space.bind(self.kv_caches)
        self._capture_graphs()

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Issue this step's copies of (device, host) block pairs out to the swap space and (host,
        device) pairs back in (swap.py: they overlap the forward pass). Call once every step, before
        `execute`, even with no pairs: the swap space counts steps by these calls."""
        assert self.swap_space is not None
        if self.tp.size > 1 and self.tp.rank == 0 and (swap_out or swap_in or self.swap_space.has_unmarked_swap_in):
            self.tp.broadcast(("swap", (swap_out, swap_in)))
        self.swap_space.swap(swap_out, swap_in)

    def take_swap_stats(self) -> SwapStats:
        """Blocks moved and seconds the copies took since the last call (this rank's)."""
        assert self.swap_space is not None
        return self.swap_space.take_stats()

    def _prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        bs = self.block_size
        inputs = StepInputs([], [], [], [], [], [0], [])
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            table = seq.block_table
            inputs.input_ids.extend(seq.token_ids[start:end])
            inputs.positions.extend(range(start, end))
            inputs.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            inputs.seq_lens.append(end)
            inputs.query_start_loc.append(inputs.query_start_loc[-1] + s.num_new_tokens)
            if s.samples:
                inputs.logits_rows.append(inputs.query_start_loc[-1] - 1)
            inputs.block_tables.append(table + [0] * (max_blocks - len(table)))
        return inputs

    def _run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Forward pass on this rank; logits (num_logits_rows, vocab) or None when nothing samples."""
        dev = self.device
        if self.swap_space is not None:
            self.swap_space.before_forward()  # blocks swapped in by earlier steps are resident
        max_query_len = max(b - a for a, b in itertools.pairwise(inputs.query_start_loc))
        hidden = None
        if self.graphs is not None and max_query_len == 1 and len(inputs.input_ids) == len(inputs.seq_lens):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.slot_mapping,
                                     inputs.block_tables, inputs.seq_lens)
        if hidden is None:
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(inputs.slot_mapping, dtype=torch.long, device=dev),
                block_tables=torch.tensor(inputs.block_tables, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int32, device=dev),
                query_start_loc=torch.tensor(inputs.query_start_loc, dtype=torch.int32, device=dev),
                max_query_len=max_query_len,
            )
            input_ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=dev)
            positions = torch.tensor(inputs.positions, dtype=torch.long, device=dev)
            plan = self.ops.plan(meta, positions, self.rope, self.block_size)
            hidden = self.model(input_ids, self.kv_caches, plan, self.ops)
        if not inputs.logits_rows:
            return None
        rows = torch.tensor(inputs.logits_rows, dtype=torch.long, device=dev)
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], rows: list[SamplingRow]) -> SampleResult:
        """Run one step; `rows` are the sampling rows of the scheduled sequences that sample, in order."""
        inputs = self._prepare(scheduled)
        if self.tp.size > 1:
            self.tp.broadcast(("step", inputs))
        logits = self._run(inputs)
        if logits is None:
            return SampleResult(token_ids=[], logprobs=[])
        return sample(logits, rows)

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks 1..N-1: run what rank 0 broadcasts until it says stop."""
        while True:
            command, payload = self.tp.broadcast()
            if command == "step":
                self._run(payload)
            elif command == "resize":
                self.resize_kv_cache(payload)
            elif command == "swap":
                self.swap_blocks(*payload)
            elif command == "stop":
                return

    def stop_workers(self) -> None:
        if self.tp.size > 1 and self.tp.rank == 0:
            self.tp.broadcast(("stop", None))

