from __future__ import annotations

from kvpilot.operator.engine_args import serve_args
from kvpilot.operator.model_source import resolve_model_source
from kvpilot.operator.spec import InferenceServiceSpec


def _args(spec: dict[str, object]) -> list[str]:
    parsed = InferenceServiceSpec.model_validate(spec)
    return serve_args(parsed, resolve_model_source(parsed.model.source), "llama")


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_defaults_are_spelled_as_vllm_flags() -> None:
    args = _args({"model": {"source": "pvc://models/llama"}})
    assert args[:6] == ["--host", "0.0.0.0", "--port", "8000", "--served-model-name", "llama"]
    assert _flag(args, "--model") == "/models/llama"
    assert _flag(args, "--block-size") == "16"
    assert _flag(args, "--preemption-mode") == "recompute"
    assert _flag(args, "--scheduler-policy") == "fcfs"
    assert _flag(args, "--gpu-memory-utilization") == "0.9"
    assert _flag(args, "--swap-space") == "4"
    assert _flag(args, "--tensor-parallel-size") == "1"
    assert "--enable-chunked-prefill" in args and "--no-enable-prefix-caching" in args
    assert "--enforce-eager" not in args


def test_switches_the_spec_turns_off_are_passed_as_no_flags() -> None:
    args = _args({"model": {"source": "embedded"},
                  "engine": {"enableChunkedPrefill": False, "enablePrefixCaching": False}})
    assert "--no-enable-chunked-prefill" in args and "--enable-chunked-prefill" not in args
    assert "--no-enable-prefix-caching" in args


def test_every_engine_field_reaches_its_flag() -> None:
    args = _args({"model": {"source": "embedded", "dtype": "bfloat16", "quantization": "fp8"},
                  "tensorParallelSize": 4,
                  "engine": {"blockSize": 32, "swapSpace": 8, "gpuMemoryUtilization": 0.85,
                             "numGpuBlocksOverride": 1000, "kvCacheDtype": "fp8", "maxNumSeqs": 128,
                             "maxNumBatchedTokens": 8192,
                             "maxModelLen": 4096, "preemptionMode": "swap", "schedulerPolicy": "priority",
                             "enableChunkedPrefill": True, "enablePrefixCaching": True, "enforceEager": True,
                             "maxQueueLen": 100, "disableLogStats": True, "metricInterval": 2.5,
                             "device": "cuda", "seed": 123456789}})
    expected = {"--dtype": "bfloat16", "--quantization": "fp8", "--tensor-parallel-size": "4",
                "--block-size": "32", "--swap-space": "8", "--gpu-memory-utilization": "0.85",
                "--num-gpu-blocks-override": "1000", "--kv-cache-dtype": "fp8", "--max-num-seqs": "128",
                "--max-num-batched-tokens": "8192", "--max-model-len": "4096", "--preemption-mode": "swap",
                "--scheduler-policy": "priority", "--max-queue-len": "100", "--metric-interval": "2.5",
                "--device": "cuda", "--seed": "123456789"}
    assert {flag: _flag(args, flag) for flag in expected} == expected
    for switch in ("--enable-chunked-prefill", "--enable-prefix-caching", "--enforce-eager", "--disable-log-stats"):
        assert switch in args


def test_embedded_model_sends_no_model_flag() -> None:
    assert "--model" not in _args({"model": {"source": "embedded"}})


def test_preset_loads_dummy_weights() -> None:
    args = _args({"model": {"source": "preset://llama-3-8b"}})
    assert (_flag(args, "--model"), _flag(args, "--load-format")) == ("llama-3-8b", "dummy")


def test_secrets_never_reach_argv() -> None:
    args = _args({"model": {"source": "embedded"}, "apiKeySecretRef": {"name": "keys"}})
    assert "--api-key" not in args and "--admin-token" not in args


def test_drain_timeout_fits_the_grace_period_after_the_pre_stop_sleep() -> None:
    """The server's drain must end before the kubelet's SIGKILL: grace - preStop - 5 s margin."""
    assert _flag(_args({"model": {"source": "embedded"}}), "--drain-timeout") == "110"  # 120 - 5 - 5
    spec = {"model": {"source": "embedded"}, "drain": {"preStopSeconds": 10, "gracePeriodSeconds": 30}}
    assert _flag(_args(spec), "--drain-timeout") == "15"
    spec = {"model": {"source": "embedded"}, "drain": {"preStopSeconds": 1, "gracePeriodSeconds": 3}}
    assert _flag(_args(spec), "--drain-timeout") == "1"
