"""The Prometheus page's KV-cache facts: `vllm:cache_config_info` names the block size, the block
count and the cache's dtype (`--kv-cache-dtype`, as vLLM labels it), and follows a re-cut."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.runtime.engine.core import EngineSnapshot
from kvpilot.runtime.server.metrics import ServerMetrics


def cache_info(metrics: ServerMetrics) -> list[dict[str, str]]:
    return [s.labels for family in text_string_to_metric_families(metrics.expose().decode())
            for s in family.samples if s.name == "vllm:cache_config_info"]


def test_cache_config_info_names_the_cache_dtype_and_follows_a_recut() -> None:
    metrics = ServerMetrics("m", cache_dtype="fp8")
    metrics.record([], EngineSnapshot(num_blocks=5825, block_size=16), None)
    assert cache_info(metrics) == [{"model_name": "m", "block_size": "16", "num_gpu_blocks": "5825",
                                    "preemption_mode": "recompute", "enable_prefix_caching": "false",
                                    "cache_dtype": "fp8"}]
    metrics.record([], EngineSnapshot(num_blocks=2912, block_size=32), None)
    assert [(i["block_size"], i["num_gpu_blocks"], i["cache_dtype"]) for i in cache_info(metrics)] == [("32", "2912", "fp8")]
    assert cache_info(ServerMetrics("m")) == []  # nothing until the core reports
