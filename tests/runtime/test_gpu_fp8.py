"""FP8 weights on CUDA (Triton activation kernels, the few-row FP8 kernel for decode batches of at
most 16, cuBLASLt's FP8 GEMM above, decode CUDA graphs): in float32 a tiny model gives the tokens
of the CPU path (de-quantised compute, itself checked against HF transformers on the de-quantised
weights), and the embedded SmolLM2 in bf16 keeps its answer. Skipped without CUDA."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from kvpilot.runtime import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_fp8_on_cuda_gives_the_cpu_paths_tokens(tmp_path: Path) -> None:
    make_tiny_model(tmp_path, "llama")
    rng = random.Random(3)
    batch = [{"prompt_token_ids": [rng.randrange(256) for _ in range(n)]} for n in [3, 50, 120, 7] * 6]  # 24 rows
    params = SamplingParams(temperature=0, max_tokens=16)
    tokens = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(tmp_path), device=device, dtype="float32", quantization="fp8", max_model_len=256,
                  max_num_seqs=24, gpu_memory_utilization=0.2)
        if device == "cuda":
            assert llm.engine.runner.graphs is not None
        tokens[device] = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
        del llm
    torch.cuda.empty_cache()
    assert tokens["cuda"] == tokens["cpu"]


def test_smollm2_fp8_in_bf16_on_cuda_keeps_its_answer() -> None:
    llm = LLM(device="cuda", quantization="fp8", max_model_len=512, gpu_memory_utilization=0.3)
    layer = llm.engine.runner.model.layers[0].gate_up_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.dtype == torch.bfloat16
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=24))
    assert answer[0].outputs[0].text == "The capital of France is Paris."
    assert llm.engine.runner.graphs.replays > 0
