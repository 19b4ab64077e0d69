"""Engine configuration: one frozen dataclass per layer, composed into `EngineConfig`.

Each validates itself in `__post_init__` and raises `ValueError` naming the field (the CLI
turns that into one line naming the flag). `EngineArgs` (args.py) is the flat, user-facing form
with vLLM's spellings; it resolves defaults that need the model (context length) and builds these.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

# the live tunables' values and bounds are the contract's, shared with the operator
from kvpilot.runtime.tunables import (
    BLOCK_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PREEMPTION_MODE,
    SCHEDULER_POLICY,
    LiveConfig,
)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# --quantization methods (`auto`, the flag's default, resolves to one of these or none: quantization.py)
QUANTIZATION_METHODS = ("fp8", "awq", "gptq")
# what the KV cache holds: auto, the model's dtype; fp8, float8 e4m3 with per-layer k and v scales
KV_CACHE_DTYPES = ("auto", "fp8")


def _check(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # resolved local folder, .gguf file, or preset name (dummy)
    served_model_name: str
    load_format: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None  # resolved: a method of QUANTIZATION_METHODS, None for unquantized
    max_model_len: int = 2048
    tokenizer: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.load_format in LOAD_FORMATS, "load_format", f"must be one of {', '.join(LOAD_FORMATS)}, not {self.load_format!r}")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        _check(self.quantization is None or self.quantization in QUANTIZATION_METHODS, "quantization",
               f"must be one of {', '.join(QUANTIZATION_METHODS)} or none, not {self.quantization!r}")
        _check(self.max_model_len > 0, "max_model_len", "must be positive")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = BLOCK_SIZE.default
    gpu_memory_utilization: float = 0.9
    swap_space_gib: float = 4.0
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = False
    # KV budget when running on the CPU, where there is no device memory to profile.
    cpu_kv_cache_space_gib: float = 1.0
    kv_cache_dtype: str = "auto"
    # fp8: measure the scales at start (True), never (False: the checkpoint's, else 1.0), or only
    # when the checkpoint has none (None); executor/kv_scales.py
    calculate_kv_scales: bool | None = None

    def __post_init__(self) -> None:
        BLOCK_SIZE.check(self.block_size)
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", f"must be in (0, 1], not {self.gpu_memory_utilization}")
        _check(self.swap_space_gib >= 0, "swap_space", f"must be >= 0 GiB, not {self.swap_space_gib}")
        _check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override > 0, "num_gpu_blocks_override", "must be positive")
        _check(self.cpu_kv_cache_space_gib > 0, "cpu_kv_cache_space", "must be positive")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        _check(self.calculate_kv_scales is None or self.kv_cache_dtype == "fp8", "calculate_kv_scales",
               "applies only with kv_cache_dtype fp8 (the scales of an FP8 KV cache)")


# The live tunables a `SchedulerConfig` holds, each a field of the contract's name: the scheduler
# reads them every step, and `LLMEngine.update_config` replaces them between steps. (The block size,
# the other live tunable, is the KV cache layout's: `CacheConfig` holds only the start's.)
SCHEDULER_TUNABLES = (MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, PREEMPTION_MODE, SCHEDULER_POLICY)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = MAX_NUM_SEQS.default
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = PREEMPTION_MODE.default
    scheduler_policy: str = SCHEDULER_POLICY.default
    max_queue_len: int | None = None
    priority_aging_s: float = 10.0  # priority: seconds of waiting worth one priority level (policies.py)
    fair_prompt_weight: float = 1.0  # fair: a prompt token's cost in a tenant's counter
    fair_output_weight: float = 2.0  # fair: a generated token's cost (Sheng et al.: output costs more)
    # prepare step N+1 on the host while the device runs step N (engine.py); None: on with CUDA,
    # off on the CPU, where ops run as they are called and the overlap would only delay outputs
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        for tunable in SCHEDULER_TUNABLES:
            tunable.check(getattr(self, tunable.name))
        _check(self.max_queue_len is None or self.max_queue_len > 0, "max_queue_len", "must be positive")
        _check(self.priority_aging_s > 0, "priority_aging", f"must be a positive number of seconds, not {self.priority_aging_s}")
        _check(self.fair_prompt_weight > 0, "fair_prompt_weight", f"must be positive, not {self.fair_prompt_weight}")
        _check(self.fair_output_weight > 0, "fair_output_weight", f"must be positive, not {self.fair_output_weight}")
        _check(
            self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
            "max_num_batched_tokens",
            f"({self.max_num_batched_tokens}) is smaller than max_model_len ({self.max_model_len}) "
            "without chunked prefill: a long prompt could never be scheduled; enable chunked prefill or raise it",
        )


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # resolved: "cpu" or "cuda"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check(self.device in ("cpu", "cuda"), "device", f"must be cpu or cuda, not {self.device!r}")
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        _check(not (self.scheduler.async_scheduling and self.device.tensor_parallel_size > 1), "async_scheduling",
               "is not supported with tensor parallelism (the other ranks would need the sampled tokens)")

    @functools.cached_property
    def tunables(self) -> LiveConfig:
        """The live tunables' values in this config, built once: the config is frozen, and the
        engine's view of it is a new one after every change (the core reads this every step)."""
        return LiveConfig(block_size=self.cache.block_size,
                          **{t.name: getattr(self.scheduler, t.name) for t in SCHEDULER_TUNABLES})

    @property
    def async_scheduling(self) -> bool:
        """Whether the engine overlaps its host work with the device's (the resolved default)."""
        if self.scheduler.async_scheduling is not None:
            return self.scheduler.async_scheduling
        return self.device.device == "cuda" and self.device.tensor_parallel_size == 1
