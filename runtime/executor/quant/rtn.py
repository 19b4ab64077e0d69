"""Round-to-nearest (RTN) integer quantisation of a weight matrix, group by group along its inputs,
as AWQ and GPTQ checkpoints store it: W ~ (q - zero) * scale with q in [0, 2**bits).

It makes the random integer weights of `--load-format dummy --quantization awq|gptq`, and the
test and accuracy checkpoints that `int_writer.py` writes in their on-disk layouts (no AWQ or GPTQ
calibration: the same number format without the error-minimising search).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RtnWeight:
    q: torch.Tensor  # (N, K) int32 in [0, 2**bits)
    scales: torch.Tensor  # (K // group_size, N) float32 (values of scale_dtype)
    zeros: torch.Tensor  # (K // group_size, N) int32 in [0, 2**bits)


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                 scale_dtype: torch.dtype = torch.float16) -> RtnWeight:
    """w (N, K) float -> its RTN quantisation. Asymmetric: each group's [min, max] (widened to
    hold 0) spread over the 2**bits levels, as AutoAWQ does; symmetric: [-amax, amax] with the
    zero point at 2**(bits - 1), as GPTQ's sym=True does. The scales are rounded to `scale_dtype`
    (the checkpoints store float16) before the integers are chosen with them."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} must divide in_features {k}")
    maxq = 2 ** bits - 1
    groups = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        amax = groups.abs().amax(-1).clamp(min=1e-8)
        scales = (2 * amax / maxq).to(scale_dtype).float()
        zeros = torch.full_like(scales, 2 ** (bits - 1))
    else:
        lo = groups.amin(-1).clamp(max=0.0)
        hi = groups.amax(-1).clamp(min=0.0)
        scales = ((hi - lo) / maxq).clamp(min=1e-8).to(scale_dtype).float()
        zeros = (-lo / scales).round().clamp(0, maxq)
    q = ((groups / scales[..., None]).round() + zeros[..., None]).clamp(0, maxq)
    return RtnWeight(q.reshape(n, k).to(torch.int32), scales.t().contiguous(),
                     zeros.t().contiguous().to(torch.int32))
