"""What the runner settles at start with throwaway forward passes, in the engine core (every
tensor-parallel rank): an FP8 cache's scales (a calibration prefill, kv_scales.py), the KV cache's
block count (on CUDA: what the card has left after a worst-case prefill) and the steps that compile
every kernel variant of a block size. The passes run for what they leave behind (scales, peak
memory, compiled kernels), not for their results.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import torch

from kvpilot.kernels.ops import Ops
from kvpilot.kernels.reference import ReferenceOps
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.executor import kv_cache, kv_scales
from kvpilot.runtime.executor.inputs import StepInputs
from kvpilot.runtime.executor.kv_cache import KVCacheLayout
from kvpilot.runtime.executor.models.llama import LlamaForCausalLM
from kvpilot.runtime.executor.swap import MAX_STAGING_BYTES

logger = logging.getLogger(__name__)

GiB = 1 << 30

# one eager forward pass over these caches at the runner's block size, with these ops (None: the
# runner's); `ModelRunner._probe`
Probe = Callable[[StepInputs, kv_scales.KVCaches, Ops | None], None]


def triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache (one folder each): how many a phase compiled rather than
    loaded, for the start-up record."""
    folder = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:
        return len(os.listdir(folder))
    except OSError:
        return 0


def settle_kv_scales(model: LlamaForCausalLM, config: EngineConfig, scratch: KVCacheLayout, vocab_size: int,
                     probe: Probe) -> str:
    """An FP8 cache's scales, settled on `model` as kv_scales.py says (`scratch`: the cache's layout
    in the model's dtype); where they came from."""
    calculate = config.cache.calculate_kv_scales
    if calculate or (calculate is None and not model.kv_scales_from_checkpoint):
        n = min(kv_scales.CALIBRATION_TOKENS, config.model.max_model_len, config.scheduler.max_num_batched_tokens)
        # the reference ops: the Triton kernels' variants for caches of the model's dtype, which
        # serving never launches, would be compiled for this one pass
        reference = ReferenceOps()
        model.set_kv_scales(kv_scales.measure(lambda step, caches: probe(step, caches, reference),
                                              scratch, vocab_size, n, config.model.seed))
        source = f"measured on {n} calibration tokens"
    else:
        source = "from the checkpoint" if model.kv_scales_from_checkpoint else "1.0 (no calibration)"
    scales = torch.stack([layer.kv_scales for layer in model.layers]).cpu()
    logger.info("FP8 KV cache: scales %s, k %.3g..%.3g, v %.3g..%.3g", source, scales[:, 0].min(),
                scales[:, 0].max(), scales[:, 1].min(), scales[:, 1].max())
    return source


def num_kv_blocks(config: EngineConfig, layout: KVCacheLayout, device: torch.device,
                  probe: Probe) -> tuple[int, int | None]:
    """This rank's KV blocks, and the largest step the device memory was sized for (CUDA: a larger
    one could run out of it; None where nothing was profiled)."""
    cache = config.cache
    profiled = None
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    elif device.type == "cuda":
        profiled = config.scheduler.max_num_batched_tokens
        num_blocks = _profile_cuda_blocks(config, layout, probe)
    else:
        num_blocks = int(cache.cpu_kv_cache_space_gib * GiB) // layout.bytes_per_block
    max_len = config.model.max_model_len
    if num_blocks * layout.block_size < max_len:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks x {layout.block_size} = {num_blocks * layout.block_size} tokens, "
            f"fewer than max_model_len ({max_len}): lower --max-model-len or give the cache more memory"
        )
    return num_blocks, profiled


def _profile_cuda_blocks(config: EngineConfig, layout: KVCacheLayout, probe: Probe) -> int:
    """Blocks that fit in gpu_memory_utilization of the card after a worst-case forward pass."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    n = min(config.scheduler.max_num_batched_tokens, config.model.max_model_len)
    _forward_probe(n, layout, probe)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    _, total = torch.cuda.mem_get_info()
    staging = min(layout.swap_bytes, MAX_STAGING_BYTES)  # the swap space's device buffer
    budget = int(total * config.cache.gpu_memory_utilization) - peak - staging
    return max(0, budget // layout.bytes_per_block)


def _forward_probe(num_tokens: int, layout: KVCacheLayout, probe: Probe) -> None:
    """One prefill of `num_tokens` tokens over a throwaway one-sequence cache."""
    blocks = -(-num_tokens // layout.block_size)
    caches = kv_cache.views(kv_cache.allocate(layout, blocks * layout.block_size), layout, num_blocks=blocks)
    step = StepInputs(input_ids=[0] * num_tokens, positions=list(range(num_tokens)),
                      slot_mapping=list(range(num_tokens)), block_tables=[list(range(blocks))],
                      seq_lens=[num_tokens], query_start_loc=[0, num_tokens], logits_rows=[num_tokens - 1])
    probe(step, caches, None)


def kernel_probes(cut: KVCacheLayout, max_model_len: int, num_kv_heads: int, device: torch.device) -> Iterator[StepInputs]:
    """One mixed step (a prefill of a few blocks beside a one-token decode) on `cut` (the cache cut
    into blocks of one size), then one-token steps with block tables wide enough for each split
    variant of the decode path (kernels/paged_attention: `split_probe_widths`): every Triton kernel
    variant a step of this size can launch. No step writes the cache (every slot is -1)."""
    bs = cut.block_size
    prefill, context = 2 * bs + 3, bs + 2
    first = list(range(-(-prefill // bs)))
    second = list(range(len(first), len(first) + -(-context // bs)))
    if second[-1] >= cut.num_blocks:
        return
    yield StepInputs(input_ids=[0] * (prefill + 1), positions=[*range(prefill), context - 1],
                     slot_mapping=[-1] * (prefill + 1), block_tables=[first, second], seq_lens=[prefill, context],
                     query_start_loc=[0, prefill, prefill + 1], logits_rows=[prefill - 1, prefill])
    try:
        from kvpilot.kernels.paged_attention import split_probe_widths
    except ImportError:  # no Triton: nothing to compile
        return
    max_blocks = -(-max_model_len // bs)
    for width in split_probe_widths(num_kv_heads, bs, max_blocks, device):
        yield StepInputs(input_ids=[0], positions=[0], slot_mapping=[-1], block_tables=[[0] * width],
                         seq_lens=[1], query_start_loc=[0, 1], logits_rows=[0])
