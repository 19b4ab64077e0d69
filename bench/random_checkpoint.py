"""A Hugging Face Llama-family folder of random weights, written once: a checkpoint of real size
for timing start-up (`kvpilot bench startup`) without downloading one.

The tensors carry Hugging Face's names and shapes for the config (a shipped preset such as
`llama-3-8b`), in bf16, sharded like the hub's checkpoints (`model-0000i-of-0000n.safetensors` and
an index); values are drawn as the model's initializer draws them (normal, std 0.02; norms 1). A
stamp file records the config the folder was written for, so a second call reuses it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STAMP = ".kvpilot-random-weights"
SHARD_BYTES = 5 << 30  # the hub's usual shard size


def tensor_shapes(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Llama-family checkpoint for `config`, in file order."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    bias = bool(config.get("attention_bias")) or config.get("model_type") == "qwen2"
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}"
        for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            yield f"{p}.self_attn.{proj}_proj.weight", (rows, hidden)
            if bias:
                yield f"{p}.self_attn.{proj}_proj.bias", (rows,)
        yield f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)
        yield f"{p}.mlp.gate_proj.weight", (inter, hidden)
        yield f"{p}.mlp.up_proj.weight", (inter, hidden)
        yield f"{p}.mlp.down_proj.weight", (hidden, inter)
        yield f"{p}.input_layernorm.weight", (hidden,)
        yield f"{p}.post_attention_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    if not config.get("tie_word_embeddings", False):
        yield "lm_head.weight", (vocab, hidden)


def _shards(config: dict[str, Any]) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(config):
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_checkpoint(config: dict[str, Any], folder: Path, seed: int = 0) -> tuple[bool, float]:
    """Write the checkpoint into `folder` unless it already holds this config's; (written, seconds).
    Drawn on a GPU when there is one (a CPU draws 8 B values slowly)."""
    import torch
    from safetensors.torch import save_file

    config = {**config, "torch_dtype": "bfloat16"}
    stamp = json.dumps(config, sort_keys=True)
    if (folder / STAMP).is_file() and (folder / STAMP).read_text() == stamp:
        return False, 0.0
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STAMP).unlink(missing_ok=True)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    shards = _shards(config)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            elif name.endswith(".bias"):
                t.zero_()
            else:
                t.normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.cpu()
            weight_map[name] = file
            total += t.numel() * 2
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (folder / STAMP).write_text(stamp)
    return True, time.perf_counter() - started
