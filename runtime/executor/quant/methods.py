"""The linear method of each `--quantization` name, and which layers of a checkpoint it covers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpilot.runtime.executor.quant.awq import AwqMethod, AwqScheme
from kvpilot.runtime.executor.quant.base import LinearMethod
from kvpilot.runtime.executor.quant.fp8 import Fp8Method, Fp8Scheme
from kvpilot.runtime.executor.quant.gptq import GptqMethod, GptqScheme
from kvpilot.runtime.executor.quant.unquantized import UnquantizedMethod

# (HF module names a layer fuses) -> its method
MethodFor = Callable[[list[str]], LinearMethod]


def _fp8(hf_config: dict[str, Any]) -> MethodFor:
    scheme = Fp8Scheme.from_hf(hf_config)
    quantized, plain = Fp8Method(scheme), UnquantizedMethod()

    def method_for(modules: list[str]) -> LinearMethod:
        ignored = {scheme.ignores(m) for m in modules}
        if len(ignored) > 1:
            raise ValueError(f"quantization_config leaves some of {', '.join(modules)} unquantized but not all; "
                             "kvpilot fuses them into one layer")
        return plain if ignored == {True} else quantized

    return method_for


def _awq(hf_config: dict[str, Any]) -> MethodFor:
    scheme = AwqScheme.from_hf(hf_config)
    quantized, plain = AwqMethod(scheme), UnquantizedMethod()

    def method_for(modules: list[str]) -> LinearMethod:
        skipped = {scheme.skips(m) for m in modules}
        if len(skipped) > 1:
            raise ValueError(f"quantization_config leaves some of {', '.join(modules)} unquantized but not all "
                             "(modules_to_not_convert); kvpilot fuses them into one layer")
        return plain if skipped == {True} else quantized

    return method_for


def _gptq(hf_config: dict[str, Any]) -> MethodFor:
    method = GptqMethod(GptqScheme.from_hf(hf_config))
    return lambda modules: method


METHODS: dict[str, Callable[[dict[str, Any]], MethodFor]] = {"fp8": _fp8, "awq": _awq, "gptq": _gptq}


def linear_methods(quantization: str | None, hf_config: dict[str, Any]) -> MethodFor:
    """The method for each linear layer of a model served with `quantization` (config.py's
    resolved name; None: unquantized), reading the checkpoint's `quantization_config`."""
    if quantization is None:
        plain = UnquantizedMethod()
        return lambda modules: plain
    return METHODS[quantization](hf_config)
