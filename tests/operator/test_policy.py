"""The tuning policy on recorded windows: each rule, hysteresis, cooldown, dwell, allowed values,
never swap without swap space, and the batch limits."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from autotune_fixtures import summary

from kvpilot.operator.autotune import (
    Decision,
    EngineLimits,
    KnobRange,
    LiveConfig,
    SloTargets,
    Thresholds,
    TuningSpec,
    WindowSummary,
    decide,
)

CALM = LiveConfig(16, "recompute", 256, 2048)
PRESSURE = LiveConfig(8, "swap", 256, 2048)
LIMITS = EngineLimits(swap_space_gib=4, max_model_len=2048, enable_chunked_prefill=True)
SPEC = TuningSpec(enabled=True)


def run(*summaries: WindowSummary, current: LiveConfig = CALM, spec: TuningSpec = SPEC,
        limits: EngineLimits = LIMITS, last_change: float | None = None) -> Decision:
    return decide({s.pod: s for s in summaries}, current, spec, limits, now=10_000.0, last_change=last_change)


def pressured(**fields: Any) -> WindowSummary:
    return summary(block_size=8, mode="swap", **fields)


def test_a_queue_over_100_switches_to_block_8_and_swap() -> None:
    d = run(summary(num_waiting_seqs=143.0))
    assert d.target == PRESSURE
    assert d.changes == {"block_size": 8, "preemption_mode": "swap"}
    assert "queue depth 143.0 > 100" in d.reason
    assert d.signals is not None and d.signals.queue_depth == 143.0


def test_a_queue_of_100_or_less_keeps_block_16_and_recompute() -> None:
    d = run(summary(num_waiting_seqs=100.0))
    assert d.target is None and d.reason.startswith("hold: calm: queue depth 100.0 <= 100")


def test_pressure_is_left_only_below_the_low_levels() -> None:
    between = run(pressured(num_waiting_seqs=70.0), current=PRESSURE)
    assert between.target is None and "not all below their low levels (50, 0.1/s)" in between.reason
    preempting = run(pressured(num_waiting_seqs=10.0, preemptions_per_s=0.5), current=PRESSURE)
    assert preempting.target is None
    calm = run(pressured(num_waiting_seqs=30.0, preemptions_per_s=0.05), current=PRESSURE)
    assert calm.target == CALM
    assert "queue depth 30.0 < 50 and preemptions 0.05/s < 0.1/s: calm" in calm.reason


def test_without_a_gap_between_levels_the_article_rule_flips_at_100() -> None:
    spec = dataclasses.replace(SPEC, thresholds=Thresholds(queue_depth_low=100, preemptions_per_s_low=1.0))
    assert run(pressured(num_waiting_seqs=99.0), current=PRESSURE, spec=spec).target == CALM
    assert run(summary(num_waiting_seqs=101.0), spec=spec).target == PRESSURE


def test_a_high_preemption_rate_means_pressure_without_a_queue() -> None:
    d = run(summary(num_waiting_seqs=5.0, preemptions_per_s=2.5))
    assert d.target == PRESSURE and "preemptions 2.50/s > 1/s" in d.reason


def test_levels_are_per_pod_means_over_the_service() -> None:
    assert run(summary("a", num_waiting_seqs=150.0), summary("b", num_waiting_seqs=30.0)).target is None
    d = run(summary("a", num_waiting_seqs=150.0), summary("b", num_waiting_seqs=90.0))
    assert d.target == PRESSURE and d.signals is not None and d.signals.num_pods == 2


def test_no_change_within_the_cooldown() -> None:
    burst = summary(num_waiting_seqs=300.0)
    d = run(burst, last_change=10_000.0 - 100)
    assert d.target is None and d.signals is None
    assert d.reason == "cooldown: 100 s since the last change, 600 s required"
    assert run(burst, last_change=10_000.0 - 600).target == PRESSURE


def test_no_change_on_less_data_than_the_dwell() -> None:
    d = run(summary(duration_s=30.0, num_waiting_seqs=300.0))
    assert d.target is None and d.reason == "not enough data: pod pod-0 has 30 s of data, 60 s needed"
    assert run().reason == "not enough data: no pod has been scraped"


def test_pods_not_on_the_config_in_force_are_left_out_and_named() -> None:
    d = run(summary("a", num_waiting_seqs=300.0), pressured(pod="b", num_waiting_seqs=0.0),
            summary("c", num_waiting_seqs=300.0, settings_changed=True))
    assert d.target == PRESSURE and d.signals is not None and d.signals.num_pods == 1
    assert "pod b reports block_size 8 (not 16), preemption_mode swap (not recompute): not the config in force" \
        in d.reason
    assert "pod c changed settings within its window" in d.reason
    alone = run(pressured(pod="b", num_waiting_seqs=300.0))
    assert alone.target is None and alone.reason.startswith("not enough data: pod b reports")


def test_targets_move_to_the_nearest_allowed_block_size() -> None:
    spec = dataclasses.replace(SPEC, allowed_block_sizes=(16, 32))
    d = run(summary(num_waiting_seqs=300.0), spec=spec)
    assert d.target == dataclasses.replace(CALM, preemption_mode="swap")
    assert "block_size 8 is not allowed" in d.reason


def test_swap_is_never_chosen_where_the_spec_does_not_allow_it() -> None:
    spec = dataclasses.replace(SPEC, allowed_preemption_modes=("recompute",))
    d = run(summary(num_waiting_seqs=300.0), spec=spec)
    assert d.target == dataclasses.replace(PRESSURE, preemption_mode="recompute")
    assert "swap is not allowed" in d.reason


def test_swap_is_never_chosen_without_swap_space() -> None:
    no_swap = dataclasses.replace(LIMITS, swap_space_gib=0)
    d = run(summary(num_waiting_seqs=300.0), limits=no_swap)
    assert d.target is not None and d.target.preemption_mode == "recompute"
    assert "no swap space (--swap-space 0)" in d.reason
    only_swap = dataclasses.replace(SPEC, allowed_preemption_modes=("swap",))
    d = run(summary(num_waiting_seqs=300.0), spec=only_swap, limits=no_swap)
    assert d.target is not None and d.target.preemption_mode == "recompute"  # the mode in force stays


def test_short_contexts_recompute_and_long_ones_swap_past_the_crossover() -> None:
    spec = dataclasses.replace(SPEC, thresholds=Thresholds(swap_min_context_tokens=1024))
    short = run(summary(num_waiting_seqs=300.0, mean_context_tokens=300.0), spec=spec)
    assert short.target == dataclasses.replace(PRESSURE, preemption_mode="recompute")
    assert "mean context 300 < 1024 tokens, cheaper to recompute" in short.reason
    long = run(summary(num_waiting_seqs=300.0, mean_context_tokens=2000.0), spec=spec)
    assert long.target == PRESSURE and "mean context 2000 >= 1024 tokens" in long.reason
    unknown = run(summary(num_waiting_seqs=300.0, mean_context_tokens=None), spec=spec)
    assert unknown.target is not None and unknown.target.preemption_mode == "recompute"


def test_a_missed_ttft_target_with_a_queue_means_pressure() -> None:
    spec = dataclasses.replace(SPEC, slo=SloTargets(ttft_p99_s=0.5))
    d = run(summary(num_waiting_seqs=60.0, ttft=2.0), spec=spec)
    assert d.target == PRESSURE
    assert "P99 TTFT 2.485 s > target 0.5 s with queue depth 60.0 > 50" in d.reason  # 2.0 s in (1, 2.5]
    assert run(summary(num_waiting_seqs=10.0, ttft=2.0), spec=spec).target is None
    assert run(summary(num_waiting_seqs=60.0, ttft=0.05), spec=spec).target is None


def test_max_num_seqs_doubles_when_it_binds_instead_of_memory() -> None:
    spec = dataclasses.replace(SPEC, max_num_seqs=KnobRange(64, 512))
    bound = summary(num_waiting_seqs=150.0, kv_cache_usage=0.1, num_running_seqs=250.0)
    d = run(bound, spec=spec)
    assert d.changes == {"max_num_seqs": 512}  # smaller blocks would not admit one more sequence
    assert "max_num_seqs binds (running 250.0 of 256, KV usage 0.10 < 0.3" in d.reason
    assert run(bound).target == PRESSURE  # no range given: the article's rule
    at_max = run(summary(num_waiting_seqs=150.0, kv_cache_usage=0.1, num_running_seqs=510.0, max_num_seqs=512),
                 spec=spec, current=dataclasses.replace(CALM, max_num_seqs=512))
    assert at_max.target is None and "max_num_seqs stays 512, at its bound" in at_max.reason


def test_max_num_seqs_halves_when_memory_thrashes() -> None:
    spec = dataclasses.replace(SPEC, max_num_seqs=KnobRange(64, 512))
    d = run(summary(preemptions_per_s=3.0, kv_cache_usage=0.95), spec=spec)
    assert d.changes == {"block_size": 8, "preemption_mode": "swap", "max_num_seqs": 128}
    assert "memory binds (KV usage 0.95 > 0.9, preemptions 3.00/s > 1/s)" in d.reason


def test_max_num_batched_tokens_trades_ttft_against_itl() -> None:
    spec = dataclasses.replace(SPEC, max_num_batched_tokens=KnobRange(512, 8192),
                               slo=SloTargets(ttft_p99_s=1.0, itl_p99_s=0.05))
    slow_decode = run(summary(itl=0.2), spec=spec)
    assert slow_decode.changes == {"max_num_batched_tokens": 1024}
    assert "P99 ITL 0.2" in slow_decode.reason and "> target 0.05 s, TTFT within its target" in slow_decode.reason
    slow_first = run(summary(ttft=5.0), spec=spec)
    assert slow_first.changes == {"max_num_batched_tokens": 4096}
    assert run(summary(ttft=5.0, itl=0.2), spec=spec).target is None  # both missed: not this knob's to fix
    unchunked = dataclasses.replace(LIMITS, enable_chunked_prefill=False)
    floor = run(summary(itl=0.2), spec=spec, limits=unchunked)
    assert floor.target is None and "stays 2048, at its bound" in floor.reason


def test_knobs_without_a_range_are_never_moved() -> None:
    spec = dataclasses.replace(SPEC, slo=SloTargets(ttft_p99_s=1.0, itl_p99_s=0.05))
    d = run(summary(itl=0.2, preemptions_per_s=3.0, kv_cache_usage=0.95), spec=spec)
    assert set(d.changes) == {"block_size", "preemption_mode"}


@pytest.mark.parametrize(("build", "field"), [
    (lambda: Thresholds(queue_depth_low=200), "queue_depth_low"),
    (lambda: Thresholds(kv_cache_usage_high=1.5), "kv_cache_usage_high"),
    (lambda: TuningSpec(allowed_block_sizes=(12,)), "allowed_block_sizes"),
    (lambda: TuningSpec(allowed_preemption_modes=()), "allowed_preemption_modes"),
    (lambda: TuningSpec(apply="restart"), "apply"),  # type: ignore[arg-type]
    (lambda: TuningSpec(interval_s=0), "interval_s"),
    (lambda: KnobRange(10, 5), "min"),
    (lambda: SloTargets(ttft_p99_s=0), "ttft_p99_s"),
    (lambda: LiveConfig(12, "recompute", 1, 1), "block_size"),
    (lambda: EngineLimits(swap_space_gib=-1, max_model_len=1, enable_chunked_prefill=False), "swap_space_gib"),
])
def test_bad_settings_fail_naming_the_field(build: Any, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        build()


def test_the_window_span_covers_the_dwell_and_a_lone_canary() -> None:
    assert TuningSpec().window_span_s == 300 + 900 + 60
