"""Build a model and fill its weights: safetensors from a local folder, or random (dummy)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.executor.checkpoint_files import checkpoint_files
from kvpilot.runtime.executor.models.llama import LlamaConfig, LlamaForCausalLM
from kvpilot.runtime.executor.parallel import TPInfo
from kvpilot.runtime.executor.quant.methods import linear_methods
from kvpilot.runtime.executor.weight_reader import checkpoint_weights, choose_reader
from kvpilot.runtime.model_source import load_preset
from kvpilot.runtime.startup import StartupLog

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


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of a model built on the meta device uninitialised memory on
    `device` (what `Module.to_empty` does, but through `torch.empty`: `to_empty`'s `empty_like` of a
    meta tensor runs a Python decomposition whose first use imports sympy, seconds of start-up)."""
    made: dict[int, torch.Tensor] = {}  # a tensor shared by two modules stays shared
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for tensors in tables:
            for name, t in tensors.items():
                if t is None:
                    continue
                if id(t) not in made:
                    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                    made[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
                tensors[name] = made[id(t)]


@contextmanager
def copy_threads(device: str | torch.device) -> Iterator[None]:
    """On the CPU, torch's intra-op threads set to one for the block: loading copies and re-lays
    tensors, which one thread does at the memory's rate, while more threads spin between the many
    short parallel regions (each copy is one) instead of helping, several times the CPU seconds for
    the same bytes (`kvpilot bench startup`'s weights phase)."""
    if torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


def load_model(config: ModelConfig, device: str, tp: TPInfo | None = None,
               startup: StartupLog | None = None) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """Build this rank's slice of the model on `device` and fill it (linear layers in the format
    of `config.quantization`; phases `model_init` and `weights` of `startup`)."""
    startup = startup or StartupLog("core")
    hf_config = hf_config_of(config)
    cfg = LlamaConfig.from_hf(hf_config)
    dtype = resolve_dtype(config.dtype, device)
    with startup.phase("model_init"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device("meta"):
                model = LlamaForCausalLM(cfg, tp, linear_methods(config.quantization, hf_config))
        finally:
            torch.set_default_dtype(previous)
        _materialize(model, torch.device(device))
        model.set_kv_scales(torch.ones(2))  # buffers are not parameters: no format fills them
    if config.load_format == "dummy":
        with startup.phase("weights", reader="dummy"), torch.no_grad():
            _fill_dummy(model, config.seed + (tp.rank if tp else 0))
            model.process_weights_after_loading()
    else:
        folder = Path(config.model)
        reader = choose_reader()
        size = sum(f.stat().st_size for f in checkpoint_files(folder))
        with startup.phase("weights", reader=reader, bytes=size), torch.no_grad(), copy_threads(device):
            model.load_weights(checkpoint_weights(folder, torch.device(device), reader))
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)  # the copies are done: the phase holds all of them
    model.eval().requires_grad_(False)
    return model, cfg
