"""FP8 models end to end on the CPU: compressed-tensors checkpoints (written by the library) load
exactly as the library de-quantizes them, within FP8 rounding of the source weights, on every
tensor-parallel rank, and generate as HF transformers does on the de-quantized weights with
FP8-rounded activations; quantizing a plain checkpoint at load gives the per-channel checkpoint's
weights; dummy FP8 weights need no files; the embedded SmolLM2 quantized at load keeps its answer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import dequantized_checkpoint, write_fp8_checkpoint

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.executor.loader import load_model
from kvpilot.runtime.executor.parallel import TPInfo

PRESETS = ("FP8_DYNAMIC", "FP8")  # per-channel weights + per-token activations; per-tensor + static


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    source, _ = tiny_models["llama"]
    return {preset: write_fp8_checkpoint(source, tmp_path_factory.mktemp(preset), preset, prompts(8, 0))
            for preset in PRESETS}


def fp8_config(folder: Path | str) -> ModelConfig:
    return ModelConfig(model=str(folder), served_model_name="t", load_format="safetensors", quantization="fp8")


@pytest.mark.parametrize("preset", PRESETS)
def test_checkpoint_loads_as_the_library_dequantizes_it(preset: str, checkpoints, tiny_models) -> None:
    folder = checkpoints[preset]
    model, _ = load_model(fp8_config(folder), "cpu")
    library = dequantized_checkpoint(folder)
    source = tiny_models["llama"][1].state_dict()
    for i, layer in enumerate(model.layers):
        for ours, theirs in (("qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("o_proj", ("self_attn.o_proj",)), ("gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                             ("down_proj", ("mlp.down_proj",))):
            linear = getattr(layer, ours)
            names = [f"model.layers.{i}.{m}.weight" for m in theirs]
            assert linear.weight.dtype == torch.float8_e4m3fn
            weight = linear.method.dequantized_weight(linear)
            assert torch.equal(weight, torch.cat([library[n] for n in names]))
            plain = torch.cat([source[n] for n in names])
            scale = weight.abs().amax(1, keepdim=True) / 448 if preset == "FP8_DYNAMIC" else weight.abs().amax() / 448
            assert ((weight - plain).abs() <= plain.abs() / 16 + scale * 2.0 ** -9).all()
    if preset == "FP8":  # one static input scale per fused layer: the largest of its shards'
        scales = [dequantized_input_scale(folder, f"model.layers.0.self_attn.{m}_proj") for m in "qkv"]
        assert model.layers[0].qkv_proj.static_scale.item() == max(scales)
    else:
        assert model.layers[0].qkv_proj.static_scale is None


def dequantized_input_scale(folder: Path, module: str) -> float:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return float(f.get_tensor(f"{module}.input_scale").item())


def test_each_rank_reads_its_slice_of_an_fp8_checkpoint(checkpoints) -> None:
    config = fp8_config(checkpoints["FP8"])
    full, _ = load_model(config, "cpu")
    ranks = [load_model(config, "cpu", TPInfo(rank, 2))[0] for rank in range(2)]
    o = [m.layers[1].o_proj for m in ranks]
    assert torch.equal(torch.cat([lin.weight.float() for lin in o], dim=1), full.layers[1].o_proj.weight.float())
    assert all(torch.equal(lin.weight_scale, full.layers[1].o_proj.weight_scale) for lin in o)
    gate_up = [m.layers[1].gate_up_proj for m in ranks]  # (gate, up) of each rank's half
    whole = full.layers[1].gate_up_proj.method.dequantized_weight(full.layers[1].gate_up_proj)
    gate, up = whole.chunk(2)
    halves = [lin.method.dequantized_weight(lin).chunk(2) for lin in gate_up]
    assert torch.equal(torch.cat([h[0] for h in halves]), gate) and torch.equal(torch.cat([h[1] for h in halves]), up)
    assert all(lin.static_scale == full.layers[1].gate_up_proj.static_scale for lin in gate_up)


def hf_fp8_emulation(folder: Path, static: bool):
    """HF transformers' model on the checkpoint's de-quantized weights (as compressed-tensors
    de-quantizes them), each linear layer's input quantized and de-quantized as FP8 first: per
    token, or with its static scale (a fused layer's shards share the largest of theirs, as the
    engine fuses them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvpilot.kernels.reference import quantize_fp8

    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    from safetensors.torch import load_file

    plain = {k: v for k, v in load_file(folder / "model.safetensors").items() if v.dtype == torch.float32
             and not k.endswith("_scale")}
    model.load_state_dict({**plain, **dequantized_checkpoint(folder)}, strict=False)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        scale = None
        if static:
            fused = ("q_proj", "k_proj", "v_proj") if "self_attn" in name and "o_proj" not in name else (
                ("gate_proj", "up_proj") if "gate" in name or "up_proj" in name else (name.rsplit(".", 1)[1],))
            base = name.rsplit(".", 1)[0]
            scale = torch.tensor([max(dequantized_input_scale(folder, f"{base}.{m}") for m in fused)])

        def fake_quant(_m, args, scale=scale):
            x = args[0]
            q, s = quantize_fp8(x.reshape(-1, x.shape[-1]), scale)
            return ((q.float() * s).reshape(x.shape),)
        module.register_forward_pre_hook(fake_quant)
    return model


@pytest.mark.parametrize("preset", PRESETS)
def test_fp8_checkpoint_generates_as_hf_on_its_dequantized_weights(preset: str, checkpoints) -> None:
    from tiny_models import hf_greedy

    folder = checkpoints[preset]
    hf = hf_fp8_emulation(folder, static=preset == "FP8")
    llm = LLM(str(folder), max_model_len=256)
    assert llm.engine.config.model.quantization == "fp8"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = prompts(6, 1)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, ids, 12) for ids in batch]


def test_quantizing_at_load_equals_the_per_channel_checkpoint(checkpoints, tiny_models) -> None:
    """Quantizing a plain checkpoint at load gives the weights compressed-tensors' FP8_DYNAMIC
    scheme writes (per-channel largest magnitude / 448, rounded to nearest)."""
    source, _ = tiny_models["llama"]
    at_load, _ = load_model(ModelConfig(model=source, served_model_name="t", quantization="fp8"), "cpu")
    saved, _ = load_model(fp8_config(checkpoints["FP8_DYNAMIC"]), "cpu")
    for ours, theirs in zip(at_load.linears(), saved.linears(), strict=True):
        assert torch.equal(ours.weight.view(torch.uint8), theirs.weight.view(torch.uint8))
        assert torch.equal(ours.weight_scale, theirs.weight_scale)


def test_dummy_fp8_weights_need_no_checkpoint() -> None:
    llm = LLM("tiny-llama", load_format="dummy", quantization="fp8")
    layer = llm.engine.runner.model.layers[0].down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and (layer.weight_scale > 0).all()
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


def test_smollm2_quantized_at_load_keeps_its_answer() -> None:
    llm = LLM(max_model_len=512, quantization="fp8")
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=24))
    assert answer[0].outputs[0].text == "The capital of France is Paris."
    assert llm.engine.runner.model.layers[5].gate_up_proj.weight.dtype == torch.float8_e4m3fn
