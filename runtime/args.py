"""`EngineArgs`: the engine's arguments with vLLM's spellings, shared by `LLM(...)` keywords and
the CLI flags of `kvpilot serve` / `kvpilot generate`.

No torch here: the CLI builds its parser from this module before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from kvpilot.runtime.arg_types import (
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    tunable,
)
from kvpilot.runtime.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATION_METHODS,
    SCHEDULER_TUNABLES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvpilot.runtime.tunables import MAX_NUM_BATCHED_TOKENS, TUNABLES, TunableArgs, check_changes


@dataclass
class EngineArgs(TunableArgs):
    """The engine's arguments; the live tunables' fields (keyword-only) come from the contract."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None
    served_model_name: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    quantization: str | None = "auto"  # auto (or None): the checkpoint's quantization_config
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_space: float = 1.0  # GiB of KV cache when running on the CPU
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: float8 e4m3, per-layer scales
    calculate_kv_scales: bool | None = None  # fp8: None measures them when the checkpoint has none
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    priority_aging: float = 10.0  # seconds of waiting worth one priority level
    fair_prompt_weight: float = 1.0
    fair_output_weight: float = 2.0
    max_queue_len: int | None = None
    async_scheduling: bool | None = None  # None: on with CUDA, off on the CPU
    device: str = "auto"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model and the defaults that depend on it; validate everything."""
        from kvpilot.runtime.model_source import resolve_model
        from kvpilot.runtime.quantization import resolve_quantization

        source = resolve_model(self.model, self.load_format, tokenizer=self.tokenizer)
        quantization = resolve_quantization(self.quantization, source.hf_config, source.path,
                                            dummy=source.load_format == "dummy")
        self._check_tensor_parallel(source.hf_config)
        native_len = source.max_position_embeddings
        max_model_len = self.max_model_len or native_len
        if max_model_len > native_len:
            raise ValueError(
                f"max_model_len: {max_model_len} exceeds the model's context length ({native_len})"
            )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        device = self.device
        if device == "auto":
            from kvpilot.runtime.cuda_probe import cuda_available

            device = "cuda" if cuda_available() else "cpu"
        model = ModelConfig(
            model=source.path,
            served_model_name=self.served_model_name or source.name,
            load_format=source.load_format,
            dtype=self.dtype,
            quantization=quantization,
            max_model_len=max_model_len,
            tokenizer=source.tokenizer,
            seed=self.seed,
        )
        cache = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space_gib=self.swap_space,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            cpu_kv_cache_space_gib=self.cpu_kv_cache_space,
            kv_cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
        )
        # the live tunables the scheduler holds, each under its contract name (the step's token
        # budget resolved above)
        tunables = {t.name: getattr(self, t.name) for t in SCHEDULER_TUNABLES if t is not MAX_NUM_BATCHED_TOKENS}
        scheduler = SchedulerConfig(
            **tunables,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            priority_aging_s=self.priority_aging,
            fair_prompt_weight=self.fair_prompt_weight,
            fair_output_weight=self.fair_output_weight,
            max_queue_len=self.max_queue_len,
            async_scheduling=self.async_scheduling,
        )
        dev = DeviceConfig(device=device, enforce_eager=self.enforce_eager,
                           tensor_parallel_size=self.tensor_parallel_size)
        return EngineConfig(model=model, cache=cache, scheduler=scheduler, device=dev)

    def _check_tensor_parallel(self, hf: dict[str, Any]) -> None:
        n = self.tensor_parallel_size
        heads = int(hf.get("num_attention_heads", 1))
        counts = {"attention heads": heads, "KV heads": int(hf.get("num_key_value_heads") or heads),
                  "intermediate size": int(hf.get("intermediate_size", n))}
        for what, count in counts.items():
            if count % n:
                raise ValueError(f"tensor_parallel_size: {n} does not divide the model's {what} ({count})")
        if n > 1 and self.device in ("auto", "cuda"):
            import torch

            if torch.cuda.is_available() and torch.cuda.device_count() < n:
                raise ValueError(f"tensor_parallel_size: {n} GPUs asked for, {torch.cuda.device_count()} visible")

    @classmethod
    def from_kwargs(cls, model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        if "tensor_parallel_degree" in kwargs:
            kwargs = dict(kwargs)
            kwargs["tensor_parallel_size"] = kwargs.pop("tensor_parallel_degree")
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def with_tuned_config(self, path: str) -> EngineArgs:
        """These args with the live tunables of `path` (a JSON object in `GET /admin/config`'s
        names, which the operator keeps current for the pods it tunes) in place of the flags'.
        A missing file changes nothing: the operator has tuned nothing yet."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return self
        try:
            tuned = json.loads(text) if text.strip() else {}
        except ValueError as e:
            raise ValueError(f"tuned_config: {path} is not JSON: {e}") from None
        if not isinstance(tuned, dict):
            raise ValueError(f"tuned_config: {path} must hold a JSON object, not {type(tuned).__name__}")
        try:
            return dataclasses.replace(self, **check_changes(tuned))
        except ValueError as e:
            raise ValueError(f"tuned_config: {path}: {e}") from None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, vLLM spellings; argparse rejects bad values with one line naming the flag."""
    d = EngineArgs()
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None, help="local HF folder, .gguf file or preset (with --load-format dummy); default: embedded SmolLM2-135M-Instruct")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder, when it differs from the model's")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--load-format", choices=LOAD_FORMATS, default=d.load_format)
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="auto: bfloat16 on GPU, float32 on CPU")
    g.add_argument("--quantization", choices=("auto", *QUANTIZATION_METHODS), default=d.quantization,
                   help="how the linear layers' weights are stored and multiplied: auto reads the checkpoint's "
                        "quantization_config (none for a plain checkpoint); fp8: float8 e4m3 weights with "
                        "per-output-channel scales and activations quantised per token (a plain checkpoint is "
                        "quantised at load; compressed-tensors FP8 checkpoints are read as saved); awq, gptq: "
                        "4-bit (GPTQ also 8-bit) integer weights with group-wise scales, read from a checkpoint "
                        "saved by AutoAWQ or AutoGPTQ/GPTQModel and de-quantised inside the GEMM kernels")
    g.add_argument("--max-model-len", type=positive_int, default=None)
    g.add_argument("--seed", type=int, default=d.seed)
    g = parser.add_argument_group("KV cache")
    g.add_argument("--swap-space", type=non_negative_float, default=d.swap_space, help="GiB of host memory for swapped KV blocks")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=d.gpu_memory_utilization)
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=None)
    g.add_argument("--cpu-kv-cache-space", type=non_negative_float, default=d.cpu_kv_cache_space, help="GiB of KV cache on the CPU")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="auto: the model's dtype; fp8: float8 e4m3 with a k and a v scale per layer (the "
                        "checkpoint's, else measured at start: see --calculate-kv-scales), twice the tokens "
                        "of bf16 in the same memory")
    g.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=d.calculate_kv_scales,
                   help="with --kv-cache-dtype fp8: measure each layer's k and v scales at start from a "
                        "calibration prefill, even over the checkpoint's (--no-calculate-kv-scales: the "
                        "checkpoint's, else 1.0; default: measure only when the checkpoint has none)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="reuse the KV blocks of prompt prefixes already computed (full blocks, matched by "
                        "chained SHA-256 digests of their tokens)")
    g = parser.add_argument_group("scheduler")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill)
    g.add_argument("--priority-aging", type=positive_float, default=d.priority_aging, metavar="SECONDS",
                   help="priority policy: a waiting request gains one priority level per SECONDS waited, so a "
                        "request is never overtaken by one of priority q arriving more than "
                        "(its priority - q) * SECONDS after it (default: %(default)s)")
    g.add_argument("--fair-prompt-weight", type=positive_float, default=d.fair_prompt_weight,
                   help="fair policy: the cost of a prompt token in a tenant's counter (default: %(default)s)")
    g.add_argument("--fair-output-weight", type=positive_float, default=d.fair_output_weight,
                   help="fair policy: the cost of a generated token in a tenant's counter (default: %(default)s, "
                        "as in Sheng et al.: output costs more)")
    g.add_argument("--max-queue-len", type=positive_int, default=None)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="schedule and prepare each step while the device still runs the previous one "
                        "(default: on with CUDA without tensor parallelism, off on the CPU)")
    g = parser.add_argument_group("live tunables", "POST /admin/config changes these while the server runs")
    for t in TUNABLES:  # spelled, held to their rules and explained by the contract (tunables.py)
        g.add_argument(t.flag, type=tunable(t), choices=t.choices, default=getattr(d, t.name), help=t.help)
    g = parser.add_argument_group("device")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device)
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--tensor-parallel-size", "--tensor-parallel-degree", dest="tensor_parallel_size",
                   type=positive_int, default=d.tensor_parallel_size)
