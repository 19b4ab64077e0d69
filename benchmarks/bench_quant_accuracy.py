"""Accuracy of quantized weights on the embedded SmolLM2-135M-Instruct against its bf16 weights, on
the CPU in float32 (so only the weights differ): perplexity on a fixed held-out text
(benchmarks/data/heldout.md, a snapshot of docs/architecture.md, written after the model was
trained), next-token top-1 agreement with bf16 along that text, and greedy agreement on 16 chat
prompts (up to 64 new tokens each: answers identical to bf16's, and the share of bf16's answer
tokens before the first difference).

Variants, each a checkpoint folder written here from the embedded model's weights rounded to bf16:
  bf16    the reference
  awq     AWQ 4-bit, round-to-nearest (int_writer.py), groups of 64: the hidden size, 576, is no
          multiple of 128
  gptq    GPTQ 4-bit symmetric, round-to-nearest, groups of 64
  gptq8   GPTQ 8-bit symmetric, round-to-nearest, groups of 64
  fp8     --quantization fp8 on the bf16 folder: weights quantized at load (e4m3, one scale per
          output channel), activations per token
  fp8-ends  an FP8 checkpoint (compressed-tensors' FP8_DYNAMIC scheme, as llm-compressor writes
          it) with the first and last decoder layers left in bf16 by its ignore list
  fp8-kv  --kv-cache-dtype fp8 (the bf16 weights; an FP8 KV cache, its scales measured at start),
          fp8-kv-unit the same with every scale 1.0 (--no-calculate-kv-scales), and fp8+kv both
          FP8 weights and an FP8 KV cache; fp8-ends+kv the fp8-ends checkpoint with an FP8 KV cache
Round-to-nearest has no calibration: real AWQ and GPTQ checkpoints choose their scales (and GPTQ
its rounding) to lose less than this.

Usage: PYTHONSAFEPATH=1 .venv/bin/python benchmarks/bench_quant_accuracy.py [--variants bf16 awq ...]
           [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.args import EngineArgs
from kvpilot.runtime.executor.quant.int_writer import IntFormat, write_int_checkpoint
from kvpilot.runtime.model_source import resolve_model

TEXT = Path(__file__).resolve().parent / "data" / "heldout.md"
WINDOW = 1024  # tokens a perplexity window holds (the text is cut into windows; none overlap)
NEW_TOKENS = 64
FORMATS = {"awq": IntFormat("awq", 4, 64), "gptq": IntFormat("gptq", 4, 64, symmetric=True),
           "gptq8": IntFormat("gptq", 8, 64, symmetric=True)}
# variants that load the bf16 folder with other engine arguments
ENGINE_VARIANTS: dict[str, dict[str, str | bool]] = {
    "fp8": {"quantization": "fp8"}, "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8-kv-unit": {"kv_cache_dtype": "fp8", "calculate_kv_scales": False},
    "fp8+kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}, "fp8-ends+kv": {"kv_cache_dtype": "fp8"}}
QUESTIONS = [
    "What is the capital of France?", "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn.", "What causes the seasons on Earth?", "Give three tips for writing clear emails.",
    "How does a bicycle stay upright?", "What is the difference between weather and climate?",
    "Summarise the plot of Romeo and Juliet.", "Why is the sky blue?", "What is photosynthesis?",
    "Name three uses of Python.", "How do vaccines work?", "What is a prime number? Give an example.",
    "Describe a cat to someone who has never seen one.", "What should I pack for a day hike?",
    "Translate 'good morning' into Spanish and French.",
]


def bf16_folder(src: Path, dst: Path) -> None:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors"):
            shutil.copy2(path, dst / path.name)
    for file in src.glob("*.safetensors"):
        tensors = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in load_file(str(file)).items()}
        save_file(tensors, str(dst / file.name), metadata={"format": "pt"})


def evaluate(folder: Path, engine_args: dict[str, str | bool] | None = None) -> dict[str, Any]:
    """Per-position log-likelihoods and top-1 tokens along the text, and greedy chat outputs."""
    started = time.perf_counter()
    llm = LLM(str(folder), dtype="float32", max_model_len=2048, **(engine_args or {}))
    ids = llm.tokenizer.encode(TEXT.read_text())
    windows = [ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW) if len(ids[i:i + WINDOW]) > 1]
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    logprobs, top1 = [], []
    for window, out in zip(windows, outs, strict=True):
        for token, entry in zip(window[1:], (out.prompt_logprobs or [])[1:], strict=True):
            assert entry is not None
            logprobs.append(entry[token].logprob)
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
    chats = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                     SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    return {"perplexity": math.exp(-sum(logprobs) / len(logprobs)), "tokens": len(logprobs), "top1": top1,
            "logprobs": logprobs,
            "greedy": [c.outputs[0].token_ids for c in chats], "seconds": time.perf_counter() - started}


def agreement(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    same_top1 = sum(a == b for a, b in zip(result["top1"], reference["top1"], strict=True))
    pairs = list(zip(result["greedy"], reference["greedy"], strict=True))
    common = [next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
              for ours, theirs in pairs]
    # the perplexity ratio's uncertainty: the standard error of the mean per-token log-likelihood
    # difference (paired, token by token), as a relative change of the ratio
    deltas = [b - a for a, b in zip(result["logprobs"], reference["logprobs"], strict=True)]
    mean = sum(deltas) / len(deltas)
    spread = math.sqrt(sum((d - mean) ** 2 for d in deltas) / (len(deltas) - 1)) if len(deltas) > 1 else 0.0
    return {"top1_agreement": same_top1 / len(reference["top1"]),
            "greedy_identical": sum(ours == theirs for ours, theirs in pairs) / len(pairs),
            "greedy_prefix_share": sum(common) / sum(len(theirs) for _, theirs in pairs),
            "perplexity_vs_bf16": result["perplexity"] / reference["perplexity"] - 1,
            "perplexity_vs_bf16_se": spread / math.sqrt(len(deltas))}


def served_variants() -> list[str]:
    """Every variant this engine can run (fp8-kv needs --kv-cache-dtype)."""
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    return ["bf16", *FORMATS, "fp8-ends", *(name for name, extra in ENGINE_VARIANTS.items() if set(extra) <= known)]


FP8_ENDS = ("fp8-ends", "fp8-ends+kv")  # variants on the fp8-ends checkpoint


def fp8_ends_checkpoint(base: Path, folder: Path) -> None:
    """base's weights in FP8 but for the first and last decoder layers, written by compressed-tensors
    (the test suite's writer: tests/support/fp8_checkpoints.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from fp8_checkpoints import write_fp8_checkpoint

    last = json.loads((base / "config.json").read_text())["num_hidden_layers"] - 1
    write_fp8_checkpoint(base, folder, "FP8_DYNAMIC", [], ignore=(r"re:.*layers\.0\..*", rf"re:.*layers\.{last}\..*"))
    for extra in base.iterdir():
        if extra.is_file() and not (folder / extra.name).exists():
            shutil.copy2(extra, folder / extra.name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=served_variants(), choices=served_variants())
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = ["bf16", *(v for v in args.variants if v != "bf16")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "bf16"
        bf16_folder(Path(resolve_model(None).path), base)
        results: dict[str, dict[str, Any]] = {}
        for name in variants:
            folder = base
            if name in FORMATS:
                folder = Path(tmp) / name
                write_int_checkpoint(base, folder, FORMATS[name])
            elif name in FP8_ENDS:
                folder = Path(tmp) / "fp8-ends"
                if not folder.exists():
                    fp8_ends_checkpoint(base, folder)
            results[name] = evaluate(folder, ENGINE_VARIANTS.get(name))
            row = {"variant": name, "perplexity": results[name]["perplexity"], "tokens": results[name]["tokens"],
                   **agreement(results[name], results["bf16"]), "seconds": results[name]["seconds"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"text": TEXT.name, "rows": rows}, indent=1))
    print(f"{'variant':11s} {'perplexity':>10s} {'vs bf16':>8s} {'+-se':>6s} {'top-1':>6s} {'greedy same':>11s} {'prefix':>6s}")
    for r in rows:
        print(f"{r['variant']:11s} {r['perplexity']:10.3f} {r['perplexity_vs_bf16']:+8.2%} {r['perplexity_vs_bf16_se']:6.2%} {r['top1_agreement']:6.1%} "
              f"{r['greedy_identical']:11.1%} {r['greedy_prefix_share']:6.1%}")


if __name__ == "__main__":
    main()
