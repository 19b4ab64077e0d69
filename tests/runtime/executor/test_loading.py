"""Model loading: the sources kvpilot reads, and one clear error for each way they go wrong."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.model_source import ModelSourceError, preset_names, resolve_model


def test_hub_ids_are_refused_without_network() -> None:
    with pytest.raises(ModelSourceError, match="never downloads"):
        resolve_model("meta-llama/Meta-Llama-3-8B")


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="not found"):
        resolve_model(str(tmp_path / "nope"))


def test_folder_without_weights_or_config(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelSourceError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))


def test_unknown_architecture_lists_the_supported_ones(tmp_path: Path, tiny_models) -> None:
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_models["llama"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(folder))


def corrupted_copy(source: str, folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> str:
    """A copy of the tiny model folder whose checkpoint went through `change`."""
    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors")
    return str(folder)


def test_mismatched_tensor_shape_names_the_weight(tmp_path: Path, tiny_models) -> None:
    def reshape(weights: dict[str, torch.Tensor]) -> None:
        weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 10)

    with pytest.raises(ValueError, match="layers.1.mlp.down_proj.weight.*shape"):
        LLM(corrupted_copy(tiny_models["llama"][0], tmp_path / "bad", reshape))


def test_missing_tensor_is_reported(tmp_path: Path, tiny_models) -> None:
    def drop(weights: dict[str, torch.Tensor]) -> None:
        del weights["model.norm.weight"]

    with pytest.raises(ValueError, match="missing.*norm"):
        LLM(corrupted_copy(tiny_models["llama"][0], tmp_path / "partial", drop))


def test_sharded_checkpoint_with_index_loads_the_same_model(tmp_path: Path, tiny_models) -> None:
    src, _ = tiny_models["qwen2"]
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(Path(src) / "config.json", folder)
    weights = load_file(Path(src) / "model.safetensors")
    names = sorted(weights)
    half = len(names) // 2
    weight_map = {}
    for shard, part in (("model-00001-of-00002.safetensors", names[:half]), ("model-00002-of-00002.safetensors", names[half:])):
        save_file({n: weights[n] for n in part}, folder / shard)
        weight_map.update({n: shard for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    params = SamplingParams(temperature=0, max_tokens=10)
    prompt = {"prompt_token_ids": [5, 17, 99, 3]}
    assert LLM(str(folder)).generate(prompt, params)[0].outputs[0].token_ids == \
        LLM(src).generate(prompt, params)[0].outputs[0].token_ids
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        LLM(str(folder))


def test_dummy_presets_need_no_files() -> None:
    assert {"llama-3-8b", "llama-2-70b", "qwen2.5-7b", "tiny-llama"} <= set(preset_names())
    llm = LLM("tiny-llama", load_format="dummy")
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    with pytest.raises(ModelSourceError, match="presets"):
        resolve_model("llama-9-9000b", "dummy")


def test_embedded_model_is_converted_once_into_the_cache(smol_folder: str) -> None:
    folder = Path(smol_folder)
    assert folder.is_relative_to(Path(os.environ.get("KVPILOT_CACHE", Path.home() / ".cache" / "kvpilot")))
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(None).path == smol_folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def test_gguf_file_path_loads(tmp_path: Path) -> None:
    from kvpilot.runtime.model_source import embedded_gguf_path

    source = resolve_model(str(embedded_gguf_path()))
    assert source.load_format == "safetensors" and source.tokenizer is not None


def test_generate_cli_prints_the_answer_and_rejects_bad_flags(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "kvpilot"
    ok = subprocess.run([str(exe), "generate", "--chat", "--max-model-len", "512", "What is the capital of France?"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "The capital of France is Paris."
    bad = subprocess.run([str(exe), "generate", "--block-size", "12", "x"], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "kvpilot generate: error: argument --block-size: must be one of 8, 16, 32, 64, not '12' (see --help)"]


def test_auto_dtype_is_bf16_on_every_cuda_device_and_fp32_on_cpu() -> None:
    from kvpilot.runtime.executor.loader import resolve_dtype

    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("auto", "cuda:1") is torch.bfloat16  # the runner passes indexed devices
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("float16", "cpu") is torch.float16
