"""--kv-cache-dtype fp8: the cache holds float8 e4m3, so the same budget holds more tokens, which
the block manager and scheduler count; each layer's k and v scales come from the checkpoint (under
every name the quantisation tools write), from a calibration prefill at start, or are 1.0; bad
scales and flags fail with one clear message."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvpilot.kernels.kv_quant import FP8, FP8_MAX
from kvpilot.runtime import LLM
from kvpilot.runtime.args import EngineArgs
from kvpilot.runtime.cli import build_parser
from kvpilot.runtime.executor import kv_scales

LAYERS = 3  # the tiny models'


def tiny_llm(folder: str, **kwargs: object) -> LLM:
    return LLM(folder, max_model_len=128, cpu_kv_cache_space=1 / 1024, swap_space=1 / 1024, **kwargs)


def layer_scales(llm: LLM) -> torch.Tensor:
    """(layers, 2): each layer's (k_scale, v_scale)."""
    return torch.stack([layer.kv_scales for layer in llm.engine.runner.model.layers])


def test_fp8_cache_holds_four_times_the_float32_tokens_in_the_same_memory(tiny_models) -> None:
    folder = tiny_models["llama"][0]
    plain, fp8 = tiny_llm(folder), tiny_llm(folder, kv_cache_dtype="fp8")
    a, b = plain.engine.runner.layout, fp8.engine.runner.layout
    assert (a.dtype, b.dtype) == (torch.float32, FP8)
    assert a.bytes_per_token == 4 * b.bytes_per_token == 4 * 2 * LAYERS * 2 * 16
    budget = 1 << 20  # cpu_kv_cache_space and swap_space: 1 MiB each
    assert (a.num_blocks, b.num_blocks) == (budget // a.bytes_per_block, budget // b.bytes_per_block) == (85, 341)
    assert fp8.engine.block_manager.num_blocks == b.num_blocks
    assert (plain.engine.scheduler.num_swap_blocks, fp8.engine.scheduler.num_swap_blocks) == (85, 341)
    assert fp8.engine.runner.kv_caches[0][0].dtype == FP8
    assert plain.engine.runner.kv_scales_source is None


def with_scale_tensors(source: str, folder: Path, tensors: dict[str, torch.Tensor]) -> str:
    """A copy of a tiny model folder with `tensors` in a second safetensors file."""
    shutil.copytree(source, folder)
    save_file(tensors, str(folder / "scales.safetensors"))
    return str(folder)


NAMINGS = {  # layer i's (k, v) scale tensors as each tool names them
    "compressed-tensors": lambda i: (f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale"),
    "output_scale": lambda i: (f"model.layers.{i}.self_attn.k_proj.output_scale",
                               f"model.layers.{i}.self_attn.v_proj.output_scale"),
    "modelopt": lambda i: (f"model.layers.{i}.self_attn.k_proj.k_scale", f"model.layers.{i}.self_attn.v_proj.v_scale"),
}


@pytest.mark.parametrize("naming", [*NAMINGS, "kv_scale"])
def test_checkpoint_scales_under_every_name(naming: str, tiny_models, tmp_path: Path) -> None:
    """The scales land in their layers (0-dim and (1,) tensors alike); an attention q_scale is
    dropped; --calculate-kv-scales measures over them; an unquantised cache loads them unused."""
    tensors, want = {}, []
    for i in range(LAYERS):
        k, v = 0.01 * (i + 1), 0.002 * (i + 1)
        if naming == "kv_scale":
            tensors[f"model.layers.{i}.self_attn.kv_scale"] = torch.tensor(k)
            v = k
        else:
            k_name, v_name = NAMINGS[naming](i)
            tensors[k_name], tensors[v_name] = torch.tensor(k), torch.tensor([v])
        tensors[f"model.layers.{i}.self_attn.q_scale"] = torch.tensor(0.5)
        want.append([k, v])
    folder = with_scale_tensors(tiny_models["llama"][0], tmp_path / "m", tensors)
    llm = tiny_llm(folder, kv_cache_dtype="fp8")
    assert llm.engine.runner.kv_scales_source == "from the checkpoint"
    torch.testing.assert_close(layer_scales(llm), torch.tensor(want))
    measured = tiny_llm(folder, kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert measured.engine.runner.kv_scales_source.startswith("measured")
    assert not torch.allclose(layer_scales(measured), torch.tensor(want))
    assert tiny_llm(folder).engine.runner.kv_scales_source is None


@pytest.mark.parametrize("tensors,message", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor([0.1, 0.2])}, "per-tensor"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}, "not a positive finite number"),
    ({f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.1) for i in range(LAYERS)}, "not both for layer 0"),
])
def test_bad_checkpoint_scales_name_the_problem(tensors: dict[str, torch.Tensor], message: str, tiny_models,
                                                 tmp_path: Path) -> None:
    folder = with_scale_tensors(tiny_models["llama"][0], tmp_path / "m", tensors)
    with pytest.raises(ValueError, match=message):
        tiny_llm(folder, kv_cache_dtype="fp8")


def test_scales_are_one_without_checkpoint_scales_or_calibration(tiny_models) -> None:
    llm = tiny_llm(tiny_models["llama"][0], kv_cache_dtype="fp8", calculate_kv_scales=False)
    assert llm.engine.runner.kv_scales_source == "1.0 (no calibration)"
    assert torch.equal(layer_scales(llm), torch.ones(LAYERS, 2))


def test_measured_scales_are_the_calibration_prefills_largest_keys_and_values(tiny_models) -> None:
    """Against Hugging Face's own cache of the same prefill (its keys after rotary, its values):
    each layer's largest magnitude times the headroom, over e4m3's largest value."""
    folder, hf = tiny_models["llama"]
    llm = tiny_llm(folder, kv_cache_dtype="fp8", seed=3)
    n = min(kv_scales.CALIBRATION_TOKENS, 128)
    ids = kv_scales.calibration_step(256, n, 3, 16).input_ids
    assert len(ids) == n and ids != kv_scales.calibration_step(256, n, 4, 16).input_ids
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    want = torch.tensor([[layer.keys.abs().max(), layer.values.abs().max()] for layer in cache.layers])
    assert llm.engine.runner.kv_scales_source == f"measured on {n} calibration tokens"
    torch.testing.assert_close(layer_scales(llm), want * kv_scales.HEADROOM / FP8_MAX, rtol=1e-4, atol=0)


def test_flags_parse_and_misuse_names_the_flag(tiny_models) -> None:
    parse = build_parser().parse_args
    args = EngineArgs.from_cli(parse(["serve", "--kv-cache-dtype", "fp8", "--no-calculate-kv-scales"]))
    assert (args.kv_cache_dtype, args.calculate_kv_scales) == ("fp8", False)
    defaults = EngineArgs.from_cli(parse(["serve"]))
    assert (defaults.kv_cache_dtype, defaults.calculate_kv_scales) == ("auto", None)
    with pytest.raises(SystemExit):
        parse(["serve", "--kv-cache-dtype", "fp16"])
    alone = EngineArgs(model=tiny_models["llama"][0], calculate_kv_scales=True)
    with pytest.raises(ValueError, match="calculate_kv_scales: applies only with kv_cache_dtype fp8"):
        alone.create_engine_config()
