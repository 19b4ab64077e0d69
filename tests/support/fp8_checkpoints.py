"""FP8 checkpoints as llm-compressor writes them, made with the `compressed-tensors` library: the
scheme applied to a HF model, its scales from the library's own `calculate_qparams` (weights from
their min/max, static input scales from a calibration pass over a few prompts), then compressed
and saved with the library's `ModelCompressor`, which also writes config.json's
quantization_config."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch


def write_fp8_checkpoint(source: str | Path, folder: Path, preset: str, calibration: list[list[int]],
                         ignore: tuple[str, ...] = ()) -> Path:
    """The HF model at `source` quantized with compressed-tensors' `preset` (FP8_DYNAMIC: per-channel
    weights, per-token activations; FP8: per-tensor weights and static input scales) into `folder`,
    leaving the LM head and the modules `ignore` names (compressed-tensors' spelling: names or
    `re:` patterns) unquantized."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    peaks = _input_peaks(model, calibration)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head", *ignore])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            w, args = module.weight.data, module.quantization_scheme.weights
            dims: dict[str, Any] = {"dim": 1, "keepdim": True} if args.strategy == "channel" else {}
            scale, _ = calculate_qparams(w.amin(**dims), w.amax(**dims), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "input_scale"):
                peak = peaks[name]
                scale, _ = calculate_qparams(-peak, peak, module.quantization_scheme.input_activations)
                module.input_scale.data.copy_(scale.reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    for extra in Path(source).glob("tokenizer*"):
        shutil.copy(extra, folder)
    return folder


def _input_peaks(model: Any, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Each linear layer's largest input magnitude over the prompts (what a static-minmax
    observer records)."""
    peaks: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            def record(_m: Any, args: tuple[torch.Tensor, ...], _out: Any, name: str = name) -> None:
                peak = args[0].detach().abs().amax()
                peaks[name] = torch.maximum(peaks.get(name, peak), peak)
            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return peaks


def dequantized_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every quantized weight of the checkpoint de-quantized by compressed-tensors itself, by the
    weight's HF name."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[name.replace(".weight", ".weight_scale")]
            args = QuantizationArgs(num_bits=8, type="float", strategy="channel" if scale.numel() > 1 else "tensor")
            out[name] = dequantize(t, scale, args=args, dtype=torch.float32)
    return out
