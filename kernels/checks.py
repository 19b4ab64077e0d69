"""Argument checks shared by the Triton launchers: each failure is a ValueError naming the
argument, so a caller that passes the wrong layout learns which one before any launch."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# what a KV cache may hold: the model's dtype, or FP8 (kv_quant.py)
CACHE_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)


def check_tensor(
    name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
) -> None:
    """`t` has `ndim` dims, one of `dtypes`, unit stride in its last dim, and sits on `device`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} dtype must be one of {allowed}, got {t.dtype}")
    if t.numel() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def check_same_dtype(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if t.dtype != other.dtype:
        raise ValueError(f"{name} dtype {t.dtype} differs from {other_name} dtype {other.dtype}")
