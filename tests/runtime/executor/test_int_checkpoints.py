"""AWQ and GPTQ checkpoints (written here by RTN in their exact on-disk layouts) load, de-quantise
to their source weights within rounding, and generate what HF transformers generates on those
de-quantised weights; the flag and the checkpoint must agree; dummy int4 weights serve."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import hf_greedy

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.args import EngineArgs
from kvpilot.runtime.executor.loader import load_model
from kvpilot.runtime.executor.quant.base import Linear
from kvpilot.runtime.executor.quant.int_writer import IntFormat, write_int_checkpoint
from kvpilot.runtime.executor.quant.methods import linear_methods
from kvpilot.runtime.quantization import QuantizationMismatchError

# the tiny models' sizes (hidden 64, intermediate 160) take groups of 32
FORMATS = {
    "awq": IntFormat("awq", 4, 32),
    "gptq": IntFormat("gptq", 4, 32, symmetric=True),
    "gptq-asym-act-order": IntFormat("gptq", 4, 32, desc_act=True),
    "gptq8-v2": IntFormat("gptq", 8, 32, symmetric=True, checkpoint_format="gptq_v2"),
}
# our layer -> HF's block and the modules it fuses, in order
HF_MODULES = {"qkv_proj": ("self_attn", ["q", "k", "v"]), "o_proj": ("self_attn", ["o"]),
              "gate_up_proj": ("mlp", ["gate", "up"]), "down_proj": ("mlp", ["down"])}


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    source = Path(tiny_models["llama"][0])
    out = {}
    for name, fmt in FORMATS.items():
        out[name] = tmp_path_factory.mktemp(name)
        write_int_checkpoint(source, out[name], fmt)
    return out


def hf_parts(hf, path: str) -> list[torch.nn.Linear]:
    """HF's linear modules behind our (fused) layer at `path` (layers.I.NAME), in our order."""
    block, names = HF_MODULES[path.split(".")[-1]]
    module = getattr(hf.model.layers[int(path.split(".")[1])], block)
    return [getattr(module, f"{n}_proj") for n in names]


def linears(llm: LLM) -> dict[str, Linear]:
    return {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("name", list(FORMATS))
def test_checkpoint_dequantises_to_its_source_within_rounding(name: str, checkpoints, tiny_models) -> None:
    hf = tiny_models["llama"][1]
    llm = LLM(str(checkpoints[name]), max_model_len=128)  # --quantization auto: read from config.json
    assert llm.engine.config.model.quantization == FORMATS[name].method
    layers = linears(llm)
    assert len(layers) == 4 * hf.config.num_hidden_layers
    for path, layer in layers.items():
        source = torch.cat([part.weight for part in hf_parts(hf, path)]).float()
        ours_w = layer.method.dequantized_weight(layer).cpu()  # the engine's device (CUDA where present)
        assert ours_w.shape == source.shape
        # one RTN step of the element's group at most (the grid's ends clip); a misread layout is off
        # by whole weights
        step = layer.scales.float().cpu().t().repeat_interleave(layer.int_weight.group_size, dim=1)
        if layer.int_weight.perm is not None:
            step = step[:, torch.argsort(layer.int_weight.perm.long().cpu())]
        assert bool(((ours_w - source).abs() <= step * 1.001 + 1e-6).all()), path


def test_layers_multiply_by_their_dequantised_weight(checkpoints) -> None:
    """Each layer's own product, the CPU twin (the engine's oneDNN packing takes over from it on
    float32 CPUs; the GPU kernels are held to it in tests/kernels/test_int_gemm.py)."""
    config = EngineArgs(model=str(checkpoints["gptq-asym-act-order"]), max_model_len=64).create_engine_config()
    model, _ = load_model(config.model, "cpu")
    for layer in model.linears():
        x = torch.randn(3, layer.input_size)
        torch.testing.assert_close(layer(x), F.linear(x, layer.method.dequantized_weight(layer)))


@pytest.mark.parametrize("name", ["awq", "gptq-asym-act-order"])
def test_checkpoint_generates_as_hf_on_the_dequantised_weights(name: str, checkpoints, tiny_models) -> None:
    hf = tiny_models["llama"][1]
    llm = LLM(str(checkpoints[name]), max_model_len=256)
    twin = type(hf)(hf.config).eval()
    twin.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for path, layer in linears(llm).items():
            parts = hf_parts(twin, path)
            for part, rows in zip(parts, layer.method.dequantized_weight(layer).split(
                    [p.weight.shape[0] for p in parts]), strict=True):
                part.weight.copy_(rows)
    rng = random.Random(name)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 40, 90)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(twin, prompt, 16)


def test_flag_that_contradicts_the_checkpoint_names_both(checkpoints) -> None:
    with pytest.raises(QuantizationMismatchError, match=r"gptq does not match the checkpoint.s quantization_config \(awq"):
        EngineArgs(model=str(checkpoints["awq"]), quantization="gptq").create_engine_config()
    assert EngineArgs(model=str(checkpoints["awq"]), quantization="awq").create_engine_config().model.quantization == "awq"


def test_int4_flag_on_a_plain_checkpoint_is_refused(tiny_models) -> None:
    with pytest.raises(QuantizationMismatchError, match="quantization: awq needs a checkpoint saved in awq"):
        EngineArgs(model=tiny_models["llama"][0], quantization="awq").create_engine_config()


@pytest.mark.parametrize("method,field,value,message", [
    ("awq", "version", "gemv", "AWQ version 'gemv' is not served"),
    ("awq", "bits", 3, "AWQ bits 3 is not served"),
    ("awq", "zero_point", False, "without zero points"),
    ("gptq", "bits", 2, "GPTQ bits 2 is not served"),
    ("gptq", "checkpoint_format", "marlin", "checkpoint_format 'marlin' is not served"),
    ("gptq", "lm_head", True, "quantized LM head"),
])
def test_configs_kvpilot_cannot_serve_are_refused_naming_the_field(method: str, field: str, value: object,
                                                                   message: str) -> None:
    config = {**FORMATS[method].quantization_config(), field: value}
    with pytest.raises(ValueError, match=message):
        linear_methods(method, {"quantization_config": config})


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dummy_weights_in_an_integer_format(method: str) -> None:
    llm = LLM("tiny-llama", load_format="dummy", quantization=method, max_model_len=64)
    layer = linears(llm)["layers.0.qkv_proj"]
    assert layer.qweight.dtype == torch.int32 and layer.int_weight.bits == 4
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["awq", "gptq-asym-act-order"])
def test_cuda_int_kernels_in_the_engine_give_the_cpu_tokens(name: str, checkpoints) -> None:
    """The Triton kernels inside the engine (decode graphs, prefill), in float32 so that greedy
    ties cannot differ: the tokens of the CPU path, which the test above holds to HF's."""
    cpu = LLM(str(checkpoints[name]), max_model_len=256)
    cuda = LLM(str(checkpoints[name]), max_model_len=256, device="cuda", dtype="float32")
    rng = random.Random(name)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 70, 130)]
    params = SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in cpu.generate([{"prompt_token_ids": p} for p in prompts], params)]
    got = [o.outputs[0].token_ids for o in cuda.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want


def test_tp2_reads_its_slices_of_the_packed_tensors(tiny_models, tmp_path: Path) -> None:
    """GPTQ has both kinds of packing: column-parallel layers cut words of packed outputs (the zero
    points, as AWQ's weights), row-parallel ones words of packed inputs and whole groups (groups of
    16: the down projection's 80 inputs a rank)."""
    write_int_checkpoint(Path(tiny_models["llama"][0]), tmp_path, IntFormat("gptq", 4, 16, symmetric=False))
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(256) for _ in range(n)]} for n in (6, 50)]
    params = SamplingParams(temperature=0, max_tokens=16)
    single = [o.outputs[0].token_ids for o in LLM(str(tmp_path), max_model_len=128).generate(prompts, params)]
    llm = LLM(str(tmp_path), max_model_len=128, tensor_parallel_size=2)
    try:
        sharded = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    assert sharded == single
