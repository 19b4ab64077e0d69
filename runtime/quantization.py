"""Which quantization a model is served with: the `--quantization` flag against the checkpoint's
own `quantization_config` (config.json), resolved before anything is loaded. Torch-free.

The flag takes `auto` (the default: whatever the checkpoint says, none for a plain one) or a
method name (`QUANTIZATION_METHODS`). A checkpoint saved in one method and a flag naming another is
an error naming both. A plain (bf16/fp16/fp32) checkpoint is quantized at load by the methods that
can (`QUANTIZE_AT_LOAD`); the others need a checkpoint in their format (or `--load-format dummy`,
which makes random weights in it). How each method lays out its tensors lives with its linear
method in `executor/quant/`.
"""

from __future__ import annotations

from typing import Any

from kvpilot.runtime.config import QUANTIZATION_METHODS

# Methods whose weights can be made from a plain checkpoint while it is read.
QUANTIZE_AT_LOAD = ("fp8",)


class QuantizationMismatchError(ValueError):
    """The --quantization flag and the checkpoint's quantization_config disagree."""


def checkpoint_quantization(hf_config: dict[str, Any]) -> str | None:
    """The method a checkpoint's `quantization_config` names (None: a plain checkpoint); a
    config kvpilot cannot read is a ValueError naming what it found."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be a JSON object, not {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors_method(qc)
    if method in QUANTIZATION_METHODS:
        return method
    raise ValueError(f"the checkpoint's quantization_config has quant_method {method or 'missing'!r}; "
                     f"kvpilot reads {', '.join(QUANTIZATION_METHODS)} and compressed-tensors (FP8)")


def _compressed_tensors_method(qc: dict[str, Any]) -> str:
    """compressed-tensors describes each group of layers by its weights' number type and width;
    kvpilot serves 8-bit float weights (the FP8 schemes), whatever their activations."""
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    kinds = {f"{(g.get('weights') or {}).get('type')}{(g.get('weights') or {}).get('num_bits')}" for g in groups}
    if kinds == {"float8"}:
        return "fp8"
    found = ", ".join(sorted(kinds)) or "no config_groups"
    raise ValueError(f"the checkpoint's compressed-tensors weights are {found}; kvpilot reads its 8-bit float "
                     "(FP8) schemes")


def resolve_quantization(flag: str | None, hf_config: dict[str, Any], where: str, dummy: bool) -> str | None:
    """The method to serve with: `flag` (None or `auto`: the checkpoint's) checked against the
    checkpoint at `where` (named in errors). `dummy`: random weights, so any method goes."""
    if flag is not None and flag != "auto" and flag not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: must be one of auto, {', '.join(QUANTIZATION_METHODS)}, not {flag!r}")
    saved = checkpoint_quantization(hf_config)
    if flag not in (None, "auto") and saved is not None and saved != flag:
        raise QuantizationMismatchError(
            f"quantization: {flag} does not match the checkpoint's quantization_config ({saved}, in {where}); "
            f"pass --quantization {saved} or auto")
    if flag in (None, "auto"):
        return saved
    if saved is None and not dummy and flag not in QUANTIZE_AT_LOAD:
        raise QuantizationMismatchError(
            f"quantization: {flag} needs a checkpoint saved in {flag}, but {where} has no quantization_config "
            f"(a plain checkpoint); kvpilot quantizes plain checkpoints at load only with {', '.join(QUANTIZE_AT_LOAD)}")
    return flag
