"""The only part of the engine that touches tensors: owns the model and the KV cache, turns a
scheduled batch into input tensors, runs the forward pass and samples.

Batch layout (varlen, no padding): the scheduled sequences' new tokens are laid back to back.
For sequence i with `c` tokens already computed and `n` new ones, rows qsl[i]:qsl[i]+n of the
batch hold its tokens c..c+n-1, at positions c..c+n-1, written to slots taken from its block
table; attention sees its whole context of c+n tokens. Only sequences whose chunk reaches their
last token produce logits.
"""

from __future__ import annotations

import logging

import torch

from kvpilot.kernels import ops as kernel_ops
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.loader import load_model, resolve_dtype
from kvpilot.runtime.models.llama import AttentionMetadata, cos_sin_cache
from kvpilot.runtime.sampler import SampleResult, SamplingRow, sample
from kvpilot.runtime.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

GiB = 1 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device.device)
        self.dtype = resolve_dtype(config.model.dtype, config.device.device)
        self.model, self.model_config = load_model(config.model, config.device.device)
        self.ops = kernel_ops.select(self.device)
        self.rope = cos_sin_cache(self.model_config, config.model.max_model_len, self.device)
        self.block_size = config.cache.block_size
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
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
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak
        return max(0, budget // self.bytes_per_block)

    def _forward_probe(self, num_tokens: int) -> None:
        """One prefill of `num_tokens` tokens over a throwaway one-sequence cache."""
        blocks = -(-num_tokens // self.block_size)
        caches = self._allocate_kv_cache(blocks)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None, :],
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            h = self.model(ids, torch.arange(num_tokens, device=self.device), caches, meta, self.rope, self.ops)
            self.model.compute_logits(h[-1:])
        del caches

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model_config
        shape = (num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        return [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]

    def resize_kv_cache(self, block_size: int) -> None:
        """Re-cut the same KV memory into blocks of `block_size` (the cache's contents are lost:
        callers preempt every running sequence first)."""
        total_bytes = self.num_blocks * self.bytes_per_block
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.block_size = block_size
        self.num_blocks = total_bytes // self.bytes_per_block
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)

    def _prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        logits_rows: list[int] = []
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            qsl.append(qsl[-1] + s.num_new_tokens)
            if s.samples:
                logits_rows.append(qsl[-1] - 1)
            tables.append(table + [0] * (max_blocks - len(table)))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta,
                torch.tensor(logits_rows, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], rows: list[SamplingRow]) -> SampleResult:
        """Run one step; `rows` are the sampling rows of the scheduled sequences that sample, in order."""
        input_ids, positions, meta, logits_rows = self._prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.rope, self.ops)
        if not rows:
            return SampleResult(token_ids=[], logprobs=[])
        logits = self.model.compute_logits(hidden[logits_rows])
        return sample(logits, rows)

