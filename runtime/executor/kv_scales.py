"""Where an FP8 KV cache's scales come from: one k scale and one v scale per layer, each the
factor that turns the stored e4m3 values back into the model's (kvpilot.kernels.kv_quant). The
model holds them (`DecoderLayer.kv_scales`); the runner settles them once at start, before the
cache is sized and any CUDA graph is captured, and nothing changes them afterwards.

1. **The checkpoint's**, under the names the quantisation tools and vLLM use (layer i's, after
   `model.layers.i.self_attn.`): `k_scale` / `v_scale` (compressed-tensors, as llm-compressor's
   `kv_cache_scheme` saves them), `k_proj.output_scale` / `v_proj.output_scale` (older
   compressed-tensors and AutoFP8 checkpoints), `k_proj.k_scale` / `v_proj.v_scale` (NVIDIA
   ModelOpt) and `kv_scale` (one for both, an older form). One value per tensor: per-head scales
   are refused. `q_scale` (attention computed in FP8) is read and dropped: attention runs in the
   model's dtype here.
2. **Measured at start** (`--calculate-kv-scales`, and by default when the checkpoint has none):
   one prefill of `CALIBRATION_TOKENS` token ids drawn at random from the vocabulary (seeded by
   `--seed`, so every start of a model gets the same scales) runs through the model into a
   scratch cache of the model's own dtype; each layer's scale is then the largest |k| (or |v|)
   it wrote, times `HEADROOM`, over e4m3's 448 (under tensor parallelism, each rank's over its own
   heads: each rank's cache is read only with its own scales). The headroom leaves room for activations larger
   than the calibration's before they saturate; it costs nothing in precision above e4m3's
   smallest normal value (2^-6 of the scale), where its relative step is the same everywhere.
3. **1.0** with `--no-calculate-kv-scales` and no checkpoint scales, as vLLM does: the cache
   then stores the values themselves, which suits models whose keys and values stay well inside
   e4m3's +-448 and far above its 2^-6 (below that the relative error grows).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from kvpilot.kernels.kv_quant import FP8_MAX
from kvpilot.runtime.executor import kv_cache
from kvpilot.runtime.executor.inputs import StepInputs
from kvpilot.runtime.executor.kv_cache import KVCacheLayout

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

# Layer i's KV-cache scale tensors, relative to the model's prefix: (layer, which) with which one
# of "k", "v", "kv" (one for both); "q" for the attention's own scale, which is dropped.
_NAMES = re.compile(r"layers\.(\d+)\.self_attn\.(?:(?P<a>k|v|kv|q)_scale|(?P<b>k|v)_proj\.output_scale"
                    r"|k_proj\.(?P<c>k)_scale|v_proj\.(?P<d>v)_scale)")

CALIBRATION_TOKENS = 512
HEADROOM = 2.0


def checkpoint_scale(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv" | "q") when checkpoint tensor `name` (without "model.") holds an
    attention scale, else None."""
    match = _NAMES.fullmatch(name)
    if match is None:
        return None
    which = next(g for g in match.group("a", "b", "c", "d") if g is not None)
    return int(match.group(1)), which


def scalar(name: str, value: torch.Tensor) -> float:
    """A per-tensor scale's one value (ValueError naming the tensor for anything else)."""
    if value.numel() != 1:
        raise ValueError(f"{name}: KV-cache scale of shape {tuple(value.shape)}; kvpilot takes one k and one "
                         "v scale per layer (per-tensor), not per head")
    scale = float(value.float().reshape(()))
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"{name}: KV-cache scale {scale} is not a positive finite number")
    return scale


def calibration_step(vocab_size: int, num_tokens: int, seed: int, block_size: int) -> StepInputs:
    """The calibration prefill: one sequence of `num_tokens` random token ids (seeded) into
    blocks 0, 1, ... of a scratch cache."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=gen).tolist()
    blocks = list(range(-(-num_tokens // block_size)))
    return StepInputs(input_ids=ids, positions=list(range(num_tokens)), slot_mapping=list(range(num_tokens)),
                      block_tables=[blocks], seq_lens=[num_tokens], query_start_loc=[0, num_tokens],
                      logits_rows=[num_tokens - 1])


def measure(prefill: Callable[[StepInputs, KVCaches], None], scratch: KVCacheLayout, vocab_size: int,
            num_tokens: int, seed: int) -> torch.Tensor:
    """Each layer's (k_scale, v_scale), (num_layers, 2) float32: `prefill` runs the calibration
    step into zeroed caches of `scratch` (a layout of the model's own dtype); a scale is the
    largest magnitude written times HEADROOM over e4m3's largest value (1.0 for all zeros)."""
    step = calibration_step(vocab_size, num_tokens, seed, scratch.block_size)
    num_blocks = len(step.block_tables[0])
    caches = kv_cache.views(kv_cache.allocate(scratch, num_blocks * scratch.block_size), scratch,
                            num_blocks=num_blocks)
    prefill(step, caches)
    amax = torch.stack([torch.stack([k.abs().amax(), v.abs().amax()]) for k, v in caches]).float()
    return torch.where(amax > 0, amax * HEADROOM / FP8_MAX, torch.ones_like(amax))
