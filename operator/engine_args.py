"""`spec` -> the `kvpilot serve` command line, in vLLM's flag spellings.

Secrets never reach argv: the admin token and the API key come in through the environment
(KVPILOT_ADMIN_TOKEN, KVPILOT_API_KEY), where `ps` and the pod spec do not show them.
"""

from __future__ import annotations

from kvpilot.runtime.tunables import TUNABLES

from .model_source import ModelSource
from .spec import InferenceServiceSpec

SERVE_PORT = 8000
# Booleans passed both ways (`--no-X` when off), so what the pod runs never rests on the
# runtime's default agreeing with the spec's.
NEGATABLE_SWITCHES = (("--enable-chunked-prefill", "enable_chunked_prefill"),
                      ("--enable-prefix-caching", "enable_prefix_caching"))
# `kvpilot serve` has only the positive form of these; off is its default (a test checks it).
SWITCHES = (("--enforce-eager", "enforce_eager"), ("--disable-log-stats", "disable_log_stats"))


def _num(value: float) -> str:
    """4.0 -> "4", 0.9 -> "0.9": what a person would type."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def serve_args(spec: InferenceServiceSpec, source: ModelSource, served_model_name: str) -> list[str]:
    """The arguments after `kvpilot serve`; defaults are passed too, so the pod spec documents them."""
    engine, model = spec.engine, spec.model
    load_format = "dummy" if source.is_preset and model.load_format == "auto" else model.load_format
    args = ["--host", "0.0.0.0", "--port", str(SERVE_PORT), "--served-model-name", served_model_name]
    if source.model_arg is not None:
        args += ["--model", source.model_arg]
    args += ["--load-format", load_format, "--dtype", model.dtype]
    if model.quantization:
        args += ["--quantization", model.quantization]
    args += [
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--swap-space", _num(engine.swap_space),
        "--gpu-memory-utilization", _num(engine.gpu_memory_utilization),
        "--kv-cache-dtype", engine.kv_cache_dtype,
        "--priority-aging", _num(engine.priority_aging),
        "--fair-prompt-weight", _num(engine.fair_prompt_weight),
        "--fair-output-weight", _num(engine.fair_output_weight),
    ]
    for tunable in TUNABLES:  # spec.engine's fields carry the contract's names; unset: the runtime's default
        value = getattr(engine, tunable.name)
        if value is not None:
            args += [tunable.flag, str(value)]
    optional: list[tuple[str, int | float | None]] = [
        ("--num-gpu-blocks-override", engine.num_gpu_blocks_override),
        ("--max-model-len", engine.max_model_len),
        ("--max-queue-len", engine.max_queue_len),
        ("--metric-interval", engine.metric_interval),
        ("--seed", engine.seed),
    ]
    for flag, value in optional:
        if value is not None:
            args += [flag, _num(value)]
    for flag, attr in NEGATABLE_SWITCHES:
        args.append(flag if getattr(engine, attr) else "--no-" + flag.removeprefix("--"))
    args += [flag for flag, attr in SWITCHES if getattr(engine, attr)]
    args += ["--device", engine.device]
    return args + ["--drain-timeout", str(drain_timeout(spec))]


DRAIN_MARGIN_SECONDS = 5


def drain_timeout(spec: InferenceServiceSpec) -> int:
    """How long the server may drain after SIGTERM: the grace period left after the preStop sleep,
    less a margin for the process to exit before the kubelet's SIGKILL (the CRD keeps the preStop
    sleep shorter than the grace period, so at least 1 s)."""
    left = spec.drain.grace_period_seconds - spec.drain.pre_stop_seconds
    return max(1, left - DRAIN_MARGIN_SECONDS)
