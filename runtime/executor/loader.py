"""Build a model and fill its weights: safetensors from a local folder, or random (dummy)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.executor.models.llama import LlamaConfig, LlamaForCausalLM
from kvpilot.runtime.executor.parallel import TPInfo
from kvpilot.runtime.executor.quant.methods import linear_methods
from kvpilot.runtime.model_source import load_preset

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """`auto` is bfloat16 on any CUDA device ("cuda", "cuda:1", ...), float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return _DTYPES[name]


def hf_config_of(config: ModelConfig) -> dict[str, Any]:
    folder = Path(config.model)
    if config.load_format == "dummy" and not folder.is_dir():
        return load_preset(config.model)
    result: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return result


class SafetensorsSlice:
    """One checkpoint tensor, read whole or in part (only the asked-for bytes leave the file)."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.bytes_read = 0

    def read(self, dim: int | None = None, start: int = 0, length: int = 0) -> torch.Tensor:
        if dim is None:
            t = self._slice[:]
        elif dim == 0:
            t = self._slice[start:start + length]
        else:
            t = self._slice[:, start:start + length]
        self.bytes_read += t.numel() * t.element_size()
        return t


def safetensors_weights(folder: Path) -> Iterator[tuple[str, SafetensorsSlice]]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards named in the index are missing: {', '.join(missing)}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, SafetensorsSlice(f, name)


def _fill_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights: the linear layers' in their method's format, the rest here."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    linears = model.linears()
    for linear in linears:
        linear.method.fill_dummy(linear, gen)
    in_linears = {id(p) for linear in linears for p in linear.parameters()}
    for name, param in model.named_parameters():
        if id(param) in in_linears:
            continue
        if param.dim() == 1:
            param.data.fill_(1.0 if name.endswith("norm") else 0.0)  # norms 1, biases 0
        else:
            param.data.normal_(0.0, 0.02, generator=gen)  # HF's initializer_range


def load_model(config: ModelConfig, device: str, tp: TPInfo | None = None) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """Build this rank's slice of the model on `device` and fill it (linear layers in the format
    of `config.quantization`)."""
    hf_config = hf_config_of(config)
    cfg = LlamaConfig.from_hf(hf_config)
    dtype = resolve_dtype(config.dtype, device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, tp, linear_methods(config.quantization, hf_config))
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    if config.load_format == "dummy":
        with torch.no_grad():
            _fill_dummy(model, config.seed + (tp.rank if tp else 0))
            model.process_weights_after_loading()
    else:
        with torch.no_grad():
            model.load_weights(safetensors_weights(Path(config.model)))
    model.eval().requires_grad_(False)
    return model, cfg
