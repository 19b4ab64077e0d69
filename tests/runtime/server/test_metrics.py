"""The Prometheus page's config facts: `vllm:cache_config_info` names the block size, the block
count and the cache's dtype (`--kv-cache-dtype`, as vLLM labels it), and follows a re-cut;
`kvpilot_live_config_info` names every live tunable in force, which the operator checks."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.runtime.engine.core import EngineSnapshot
from kvpilot.runtime.server.metrics import ServerMetrics
from kvpilot.runtime.tunables import TUNABLES, LiveConfig

LIVE = LiveConfig(block_size=16, preemption_mode="recompute", max_num_seqs=64, max_num_batched_tokens=2048)


def cache_info(metrics: ServerMetrics) -> list[dict[str, str]]:
    return [s.labels for family in text_string_to_metric_families(metrics.expose().decode())
            for s in family.samples if s.name == "vllm:cache_config_info"]


def test_cache_config_info_names_the_cache_dtype_and_follows_a_recut() -> None:
    metrics = ServerMetrics("m", cache_dtype="fp8")
    metrics.record([], EngineSnapshot(num_blocks=5825, live=LIVE), None)
    assert cache_info(metrics) == [{"model_name": "m", "block_size": "16", "num_gpu_blocks": "5825",
                                    "preemption_mode": "recompute", "enable_prefix_caching": "false",
                                    "cache_dtype": "fp8"}]
    metrics.record([], EngineSnapshot(num_blocks=2912, live=dataclasses.replace(LIVE, block_size=32)), None)
    assert [(i["block_size"], i["num_gpu_blocks"], i["cache_dtype"]) for i in cache_info(metrics)] == [("32", "2912", "fp8")]
    assert cache_info(ServerMetrics("m")) == []  # nothing until the core reports


def live_config_info(metrics: ServerMetrics) -> list[dict[str, str]]:
    return [s.labels for family in text_string_to_metric_families(metrics.expose().decode())
            for s in family.samples if s.name == "kvpilot_live_config_info"]


def test_live_config_info_labels_every_live_tunable_by_its_name_and_follows_a_change() -> None:
    metrics = ServerMetrics("m")
    metrics.record([], EngineSnapshot(num_blocks=100, live=LIVE), None)
    (info,) = live_config_info(metrics)
    assert info == {"model_name": "m", **{t.name: str(getattr(LIVE, t.name)) for t in TUNABLES}}
    assert (info["block_size"], info["preemption_mode"], info["max_num_batched_tokens"]) == ("16", "recompute", "2048")
    metrics.record([], EngineSnapshot(num_blocks=100, live=dataclasses.replace(LIVE, max_num_seqs=128, scheduler_policy="fair")),
                   None)
    (info,) = live_config_info(metrics)  # the old series is gone: one config in force
    assert (info["max_num_seqs"], info["scheduler_policy"]) == ("128", "fair")
    assert set(info) - {"model_name"} == {t.name for t in TUNABLES}
    assert live_config_info(ServerMetrics("m")) == []  # nothing until the core reports
