"""Matrix products with integer weights (AWQ and GPTQ checkpoints, 4- or 8-bit), de-quantised
inside the kernels' inner loops so that only the packed bytes cross the memory bus.

The layout every kernel here reads (`layout.IntWeight`; the loaders convert AWQ's and GPTQ's
on-disk layouts into it once):
  qweight  (N, K * bits / 32) int32   row n holds output feature n's K integers, packed along K:
           q[n, k] is bits [bits * (k % pack), bits * (k % pack + 1)) of qweight[n, k // pack],
           pack = 32 // bits (nn.Linear's (out, in) orientation, so a tile of a few rows and many
           packed columns is one contiguous run per row)
  scales   (K // group_size, N)         float, one per group of group_size inputs and output
  zeros    (K // group_size, N)         the same dtype, integer-valued zero points
  perm     (K,) int32 or None           column k of the packed matrix belongs to input perm[k]
           (GPTQ's act-order: rows are stored sorted by group, the activations are gathered)
  W[n, k] = (q[n, k] - zeros[k // group_size, n]) * scales[k // group_size, n];  y = x[:, perm] @ W^T

Modules, one concept each:
* `layout.py`: `IntWeight`, packing and unpacking, and the plain-torch twin (de-quantise, then
  `F.linear`) that the kernels are tested against and the CPU path runs;
* `unpack.py`: the device functions both kernels share (expand packed words, de-quantise a tile);
* `decode_int4.py`: 4-bit weights at M <= 16, zero point and scale applied per group rather than
  per weight, two weights per 32-bit instruction, on the tensor cores;
* `decode.py`: the kernel for the other decode-sized batches (M <= 64: 8-bit weights, 4-bit past
  M = 16), many programs over N, optional split-K;
* `prefill.py`: the tiled kernel for larger M (compute-bound), a bf16/fp16 tile per inner step;
* `splits.py`: the decode kernels' split-K partials summed and rounded in one launch;
* `launcher.py`: argument checks, tile choice per shape and which kernel serves a batch.
`unpack.py` serves `decode.py` and `prefill.py`; `decode_int4.py` unpacks on its own (16-bit
floats, two per word operation, in a K order of its choosing).
"""

from typing import Any

from kvpilot.kernels.int_gemm.layout import (
           IntWeight,
           dequantize,
           int_linear_reference,
           pack_rows,
           unpack_rows,
)

__all__ = ["DECODE_MAX_M", "IntWeight", "dequantize", "int_gemm", "int_gemm_decode", "int_gemm_prefill",
           "int_linear_reference", "pack_rows", "unpack_rows"]

# the kernels import Triton (a good part of a second), which a process that only reads or converts
# integer weights, or runs them on the CPU, never needs: they load on first use
_LAUNCHER = frozenset({"DECODE_MAX_M", "int_gemm", "int_gemm_decode", "int_gemm_prefill"})


def __getattr__(name: str) -> Any:
    if name in _LAUNCHER:
        from kvpilot.kernels.int_gemm import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
