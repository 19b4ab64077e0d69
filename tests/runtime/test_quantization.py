"""--quantization against the checkpoint's quantization_config: auto reads it, a flag that
disagrees is one error naming both, and plain checkpoints are quantized at load only by methods
that can."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.runtime.quantization import (
    QuantizationMismatchError,
    checkpoint_quantization,
    resolve_quantization,
)

PLAIN: dict[str, Any] = {"model_type": "llama"}


def compressed_tensors(weights: dict[str, Any]) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": weights,
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": group}, "ignore": ["lm_head"]}}


FP8_CT = compressed_tensors({"num_bits": 8, "type": "float", "strategy": "channel"})
AWQ = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}}


def test_auto_reads_the_checkpoint() -> None:
    assert resolve_quantization("auto", FP8_CT, "/m", dummy=False) == "fp8"
    assert resolve_quantization("auto", AWQ, "/m", dummy=False) == "awq"
    assert resolve_quantization(None, {"quantization_config": {"quant_method": "gptq"}}, "/m", dummy=False) == "gptq"
    assert resolve_quantization(None, FP8_CT, "/m", dummy=False) == "fp8"
    assert resolve_quantization("auto", {"quantization_config": {"quant_method": "fp8"}}, "/m", dummy=False) == "fp8"
    assert resolve_quantization("auto", PLAIN, "/m", dummy=False) is None


def test_fp8_quantizes_a_plain_checkpoint_or_reads_an_fp8_one() -> None:
    assert resolve_quantization("fp8", PLAIN, "/m", dummy=False) == "fp8"
    assert resolve_quantization("fp8", FP8_CT, "/m", dummy=False) == "fp8"


def test_a_flag_that_disagrees_with_the_checkpoint_names_both() -> None:
    with pytest.raises(QuantizationMismatchError, match=r"fp8 does not match the checkpoint's quantization_config \(awq, in /ckpt\)"):
        resolve_quantization("fp8", AWQ, "/ckpt", dummy=False)


def test_integer_methods_need_a_checkpoint_in_their_format_or_dummy_weights() -> None:
    with pytest.raises(QuantizationMismatchError, match="quantization: gptq needs a checkpoint saved in gptq"):
        resolve_quantization("gptq", PLAIN, "/m", dummy=False)
    assert resolve_quantization("awq", PLAIN, "llama-3-8b", dummy=True) == "awq"


def test_unknown_formats_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'"):
        checkpoint_quantization({"quantization_config": {"quant_method": "bitsandbytes"}})
    int4 = compressed_tensors({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128})
    with pytest.raises(ValueError, match="compressed-tensors weights are int4"):
        checkpoint_quantization(int4)
    with pytest.raises(ValueError, match="must be one of auto, fp8, awq, gptq"):
        resolve_quantization("int3", PLAIN, "/m", dummy=False)
