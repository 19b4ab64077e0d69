"""The small kernels of a decode step, timed as the engine runs them: 32 launches (one a layer, each
on its own layer's tensors) recorded into one CUDA graph and replayed, Llama-3-8B shapes, bf16.

  decode1   batch-1 decode attention over block tables as wide as the decode graphs' (max_model_len
            8192, block 16) at several contexts: the split-KV slices' minimum length swept
            (`DecodeConfig.min_split`), and one program per KV head (no split) for comparison
  silu      silu(gate) * up fused (`kernels/activation.py`) against torch's two kernels, at 1, 256
            and 8,192 tokens; the fused output is checked bit for bit against torch's
  rotary    rotary + KV-cache write fused (`rotary.rotary_and_write_kv`) against the two launches

Usage (GPU): PYTHONSAFEPATH=1 python3 benchmarks/bench_step_kernels.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton

from kvpilot.kernels import cache, reference, rotary
from kvpilot.kernels.activation import silu_and_mul
from kvpilot.kernels.paged_attention import DecodeConfig, paged_attention_with

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, WIDTH = 32, 32, 8, 128, 16, 512
INTERMEDIATE = 14336


def per_launch_us(step: Callable[[int], object]) -> float:
    """step(layer) for the 32 layers captured into one graph; median microseconds per launch."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer in range(LAYERS):
            step(layer)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            step(layer)
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
    return ms * 1e3 / LAYERS


def decode1(rows: list[dict[str, object]]) -> None:
    caches = [[torch.randn(WIDTH + 1, KV_HEADS, BLOCK, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(2)] for _ in range(LAYERS)]
    tables = torch.randperm(WIDTH, device="cuda").int()[None, :]
    variants: dict[str, tuple[int | None, DecodeConfig]] = {
        f"min_split={m}": (None, DecodeConfig(min_split=m)) for m in (32, 64, 128, 256)}
    variants["no split"] = (1, DecodeConfig())
    for ctx in (128, 384, 640, 1024, 2048, 4096):
        for name, (splits, config) in variants.items():
            us, err = _decode1_case(caches, tables, ctx, splits, config)
            rows.append({"group": "decode1", "ctx": ctx, "variant": name, "us": us, "rel_err": err,
                         "GBps": 2 * ctx * KV_HEADS * HEAD_DIM * 2 / us / 1e3})
            print(json.dumps(rows[-1]), flush=True)


def _decode1_case(caches: list[list[torch.Tensor]], tables: torch.Tensor, ctx: int, splits: int | None,
                  config: DecodeConfig) -> tuple[float, float]:
    """(microseconds a launch, relative error against the reference) of one sequence's decode."""
    scale = HEAD_DIM ** -0.5
    q = torch.randn(1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")

    def step(layer: int) -> None:
        paged_attention_with(q, *caches[layer], tables, seq_lens, qsl, scale, max_query_len=1,
                             num_splits=splits, decode=config, out=out)
    step(0)
    expected = reference.paged_attention(q, *caches[0], tables, seq_lens, qsl, scale)
    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    return per_launch_us(step), err


def silu(rows: list[dict[str, object]]) -> None:
    for tokens in (1, 256, 8192):
        buffers = 4 if tokens > 256 else LAYERS  # 4 x 470 MB at 8,192 tokens: past any cache
        xs = [(torch.randn(tokens, 2 * INTERMEDIATE, device="cuda") * 4).bfloat16() for _ in range(buffers)]
        mismatches = sum(int((silu_and_mul(x) != reference.silu_and_mul(x)).sum()) for x in xs)
        for name, fn in (("fused", silu_and_mul), ("torch", reference.silu_and_mul)):
            us = per_launch_us(partial(_on_layer, fn, xs))
            rows.append({"group": "silu", "tokens": tokens, "variant": name, "us": us,
                         "mismatches": mismatches, "GBps": tokens * INTERMEDIATE * 3 * 2 / us / 1e3})
            print(json.dumps(rows[-1]), flush=True)


def _on_layer(fn: Callable[[torch.Tensor], object], xs: list[torch.Tensor], layer: int) -> None:
    fn(xs[layer % len(xs)])


def rotary_write(rows: list[dict[str, object]]) -> None:
    for tokens in (1, 256):
        case = RotaryCase(tokens)
        for name, fn in (("fused", case.fused), ("apart", case.apart)):
            rows.append({"group": "rotary", "tokens": tokens, "variant": name, "us": per_launch_us(fn)})
            print(json.dumps(rows[-1]), flush=True)


class RotaryCase:
    """Each layer's fused qkv output, caches, and the step's positions and slots."""

    def __init__(self, tokens: int, num_blocks: int = 4096) -> None:
        self.tokens = tokens
        self.table = torch.randn(8192, HEAD_DIM, device="cuda")
        self.qkv = [torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                    for _ in range(LAYERS)]
        self.caches = [[torch.zeros(num_blocks, KV_HEADS, BLOCK, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                        .transpose(1, 2) for _ in range(2)] for _ in range(LAYERS)]
        self.positions = torch.randint(0, 8192, (tokens,), device="cuda")
        self.slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:tokens]

    def views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, t = self.qkv[layer], self.tokens
        q = x[:, :HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM)
        k = x[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM)
        return q, k, x[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(t, KV_HEADS, HEAD_DIM)

    def fused(self, layer: int) -> None:
        q, k, v = self.views(layer)
        rotary.rotary_and_write_kv(self.positions, q, k, self.table, v, *self.caches[layer], self.slots)

    def apart(self, layer: int) -> None:
        q, k, v = self.views(layer)
        rotary.rotary_embedding(self.positions, q, k, self.table)
        cache.write_kv_cache(k, v, *self.caches[layer], self.slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON")
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps(head), flush=True)
    for bench in (decode1, silu, rotary_write):
        bench(rows)
    if args.out:
        args.out.write_text(json.dumps({**head, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
