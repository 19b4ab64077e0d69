"""The autotuner's memory of measured outcomes and switch pauses, and the policy rules that use
it, on recorded windows: a configuration measured worse is left or not entered, untried mixes are
tried in order, a knob that measured within the tolerance is left alone, calm keeps a
configuration that measured better than the calm target, and a switch whose pause costs more
tokens than it is expected to gain over the dwell is not made. The memory goes through status
and back unchanged."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from autotune_fixtures import summary

from kvpilot.operator.autotune import (
    EngineLimits,
    EngineTarget,
    Estimate,
    KnobRange,
    Knobs,
    LiveConfig,
    Outcomes,
    Thresholds,
    TuningSpec,
    decide,
)
from kvpilot.operator.autotune.outcomes import MAX_OUTCOMES

LIMITS = EngineLimits(swap_space_gib=4, max_model_len=2048, enable_chunked_prefill=True)
SPEC = TuningSpec(enabled=True)  # tolerance 5%
B16_REC, B16_SWAP = Knobs(16, "recompute", 256, 2048), Knobs(16, "swap", 256, 2048)
B8_REC, B8_SWAP = Knobs(8, "recompute", 256, 2048), Knobs(8, "swap", 256, 2048)
T = Thresholds()  # queue depth low 50, preemptions high 1/s


def config(knobs: Knobs) -> LiveConfig:
    return LiveConfig(*dataclasses.astuple(knobs))


def at(knobs: Knobs, **fields: float) -> dict[str, Any]:
    """summary()'s arguments for a window run on `knobs`."""
    return {"block_size": knobs.block_size, "mode": knobs.preemption_mode, "max_num_seqs": knobs.max_num_seqs,
            "max_num_batched_tokens": knobs.max_num_batched_tokens, **fields}


def measured(**rates: float) -> dict[Knobs, Estimate]:
    """`b16_swap=900.0` -> {16/swap: 900 tok/s over 600 s}, at the batch limits 256 and 2048."""
    out = {}
    for name, rate in rates.items():
        block, mode = name[1:].split("_")
        out[Knobs(int(block), "recompute" if mode == "rec" else "swap", 256, 2048)] = Estimate(rate, 0.0, 600.0, 60)
    return out


def pause(source: Knobs, target: Knobs, seconds: float) -> dict[tuple[EngineTarget, EngineTarget], float]:
    return {(source.engine, target.engine): seconds}


def decide_on(held: Knobs, queue: float, known: dict[Knobs, Estimate], spec: TuningSpec = SPEC,
              limits: EngineLimits = LIMITS,
              pauses: dict[tuple[EngineTarget, EngineTarget], float] | None = None) -> tuple[Knobs | None, str]:
    window = summary(**at(held, num_waiting_seqs=queue))
    d = decide({"pod-0": window}, config(held), spec, limits, now=10_000.0, last_change=None, measured=known,
               pauses=pauses)
    return (None if d.target is None else Knobs.of(d.target)), d.reason


# --- the memory ---

def test_a_saturated_span_is_counted_as_its_configurations_throughput() -> None:
    o = Outcomes()
    w = summary(block_size=8, mode="swap", duration_s=10.0, num_waiting_seqs=80.0, prompt_tokens_per_s=300.0,
                generation_tokens_per_s=200.0)
    assert o.observe({"pod-0": w}, T) == B8_SWAP
    # the 200 requests it finished: 300 prompt and 200 generated tokens/s over 10 s
    assert o.estimate(B8_SWAP) == Estimate(500.0, math.inf, 10.0, 1, mix=(15.0, 10.0))


def test_spans_are_weighted_by_their_length() -> None:
    o = Outcomes()
    for seconds, rate in ((30.0, 100.0), (10.0, 500.0)):
        o.observe({"pod-0": summary(duration_s=seconds, num_waiting_seqs=80.0, prompt_tokens_per_s=rate,
                                    generation_tokens_per_s=0.0)}, T)
    e = o.estimate(B16_REC)
    assert e is not None and e.tokens_per_s == 200.0 and e.seconds == 40.0 and e.num_windows == 2
    assert e.stderr == pytest.approx(math.sqrt((0.75 * 100**2 + 0.25 * 500**2 - 200**2) / 1))


def test_a_gap_inside_the_noise_between_windows_is_no_difference() -> None:
    steady, noisy = Estimate(1000.0, 10.0, 600.0, 60), Estimate(1200.0, 100.0, 600.0, 60)
    assert not noisy.beats(steady, 0.05)  # 200 tok/s apart, twice the noise 201
    assert Estimate(1200.0, 20.0, 600.0, 60).beats(steady, 0.05)
    assert not Estimate(1040.0, 0.0, 600.0, 60).beats(steady, 0.05)  # within the tolerance
    one_window = Estimate(5000.0, math.inf, 60.0, 1)
    assert not one_window.beats(steady, 0.05) and not steady.beats(one_window, 0.05)


def test_estimates_measured_on_different_request_mixes_never_beat_each_other() -> None:
    """Documents get through more tokens per second than chat on any configuration."""
    chat, documents = Estimate(1000.0, 10.0, 600.0, 60, (150.0, 150.0)), Estimate(3000.0, 10.0, 600.0, 60, (2000.0, 100.0))
    assert not documents.beats(chat, 0.05) and not chat.beats(documents, 0.05)
    assert dataclasses.replace(documents, mix=(160.0, 140.0)).beats(chat, 0.05)  # within 20%: it compares
    assert dataclasses.replace(documents, mix=None).beats(chat, 0.05)  # unknown (an older status): as before


def test_calm_returns_to_its_target_when_the_better_figure_was_measured_on_other_traffic() -> None:
    known = measured(b16_rec=1000.0, b8_swap=1300.0)
    assert decide_on(B8_SWAP, 0.0, known)[0] is None  # kept: 8/swap measured better
    on_documents = {**known, B8_SWAP: dataclasses.replace(known[B8_SWAP], mix=(2000.0, 100.0)),
                    B16_REC: dataclasses.replace(known[B16_REC], mix=(150.0, 150.0))}
    assert decide_on(B8_SWAP, 0.0, on_documents)[0] == B16_REC


def test_an_unsaturated_span_says_nothing_about_capacity() -> None:
    o = Outcomes()
    assert o.observe({"pod-0": summary(num_waiting_seqs=10.0, preemptions_per_s=0.5)}, T) is None
    assert o.estimate(B16_REC) is None
    assert o.observe({"pod-0": summary(num_waiting_seqs=0.0, preemptions_per_s=2.0)}, T) == B16_REC


def test_a_queue_under_one_is_not_saturation_even_with_a_low_level_of_zero() -> None:
    zero = Thresholds(queue_depth_low=0)
    assert Outcomes().observe({"pod-0": summary(num_waiting_seqs=0.4)}, zero) is None


def test_spans_across_a_switch_a_restart_or_mixed_pods_are_not_counted() -> None:
    o, busy = Outcomes(), {"num_waiting_seqs": 80.0}
    assert o.observe({"pod-0": summary(**busy)}, T, last_change=995.0) is None  # span starts at 940
    assert o.observe({"pod-0": summary(settings_changed=True, **busy)}, T) is None
    assert o.observe({"pod-0": summary(num_restarts=1, **busy)}, T) is None
    assert o.observe({"a": summary("a", **busy), "b": summary("b", block_size=8, **busy)}, T) is None
    assert o.estimate(B16_REC) is None and o.estimate(B8_REC) is None
    assert o.observe({"pod-0": summary(**busy)}, T, last_change=900.0) == B16_REC


def test_only_estimates_with_enough_saturated_time_are_measured() -> None:
    o = Outcomes()
    o.observe({"pod-0": summary(duration_s=20.0, num_waiting_seqs=80.0)}, T)
    assert o.measured(30.0) == {}
    o.observe({"pod-0": summary(duration_s=20.0, num_waiting_seqs=80.0)}, T)
    assert set(o.measured(30.0)) == {B16_REC}


def test_capacities_at_other_batch_limits_are_kept_apart() -> None:
    o, busy = Outcomes(), {"duration_s": 30.0, "num_waiting_seqs": 80.0, "generation_tokens_per_s": 0.0}
    wide = dataclasses.replace(B16_REC, max_num_seqs=512)
    assert o.observe({"pod-0": summary(**at(B16_REC, prompt_tokens_per_s=1000.0, **busy))}, T) == B16_REC
    assert o.observe({"pod-0": summary(**at(wide, prompt_tokens_per_s=1500.0, **busy))}, T) == wide
    rates = {k: e.tokens_per_s for k, e in o.measured(30.0).items()}
    assert rates == {B16_REC: 1000.0, wide: 1500.0}
    rows = o.to_status()["outcomes"]
    assert [(r["maxNumSeqs"], r["tokensPerSecond"]) for r in rows] == [(256, 1000.0), (512, 1500.0)]
    # and pods on two batch limits at once measure neither
    mixed = {"a": summary("a", **at(B16_REC, **busy)), "b": summary("b", **at(wide, **busy))}
    assert o.observe(mixed, T) is None


def test_status_keeps_the_configurations_with_the_most_saturated_time() -> None:
    o = Outcomes()
    for i in range(MAX_OUTCOMES + 6):
        o.observe({"pod-0": summary(**at(Knobs(16, "recompute", 2048, 1 + i), duration_s=10.0 + i,
                                         num_waiting_seqs=80.0))}, T)
    rows = o.to_status()["outcomes"]
    assert len(rows) == MAX_OUTCOMES and min(r["seconds"] for r in rows) == 16.0


# --- the policy with measurements ---

def test_the_policy_weighs_only_capacities_measured_at_the_batch_limits_in_force() -> None:
    """8/swap measured worse at twice the batch says nothing of it at the batch in force: untried."""
    elsewhere = {dataclasses.replace(k, max_num_seqs=512): e for k, e in measured(b8_swap=700.0).items()}
    target, reason = decide_on(B16_REC, 300.0, {**measured(b16_rec=1000.0), **elsewhere})
    assert target == B8_SWAP and "unmeasured, tried" in reason
    # the same figure at the limits in force sends the service to a mix of the two instead
    assert decide_on(B16_REC, 300.0, measured(b16_rec=1000.0, b8_swap=700.0))[0] == B16_SWAP


def test_an_unmeasured_pressure_target_is_tried_as_the_article_says() -> None:
    target, reason = decide_on(B16_REC, 300.0, measured(b16_rec=1000.0))
    assert target == B8_SWAP and "unmeasured, tried" in reason


def test_a_pressure_target_measured_worse_leads_to_the_mix_that_keeps_the_better_block_size() -> None:
    target, reason = decide_on(B8_SWAP, 300.0, measured(b16_rec=1000.0, b8_swap=700.0))
    assert target == B16_SWAP
    assert "measured 700 tok/s over 600 s against 16/recompute 1000 tok/s" in reason and "trying 16/swap" in reason


def test_with_every_mix_measured_pressure_goes_to_the_best_measured() -> None:
    target, reason = decide_on(B16_SWAP, 300.0, measured(b16_rec=1000.0, b8_swap=700.0, b16_swap=1300.0))
    assert target is None and "16/swap, the best measured (1300 tok/s" in reason
    target, reason = decide_on(B8_SWAP, 300.0, measured(b16_rec=1000.0, b8_swap=700.0, b16_swap=1300.0))
    assert target == B16_SWAP and "against 700 tok/s" in reason
    # from calm, a burst goes straight to what measured best: nothing is tried again
    assert decide_on(B16_REC, 300.0, measured(b16_rec=1000.0, b8_swap=700.0, b16_swap=1300.0))[0] == B16_SWAP


def test_a_pressure_target_as_good_as_the_config_in_force_is_kept() -> None:
    target, reason = decide_on(B8_SWAP, 300.0, measured(b16_rec=1000.0, b8_swap=980.0))
    assert target is None and "8/swap stays" in reason


def test_a_knob_that_measured_within_the_tolerance_is_left_alone() -> None:
    # block 8 tried and within 5% of block 16: the service does not move back for it
    known = measured(b16_rec=1000.0, b8_swap=700.0, b16_swap=1300.0, b8_rec=1320.0)
    target, reason = decide_on(B16_SWAP, 300.0, known)
    assert target is None and "16/swap stays: 8/recompute measured 1320 tok/s" in reason and "within 5%" in reason
    beyond = measured(b16_rec=1000.0, b8_swap=700.0, b16_swap=1300.0, b8_rec=1400.0)
    assert decide_on(B16_SWAP, 300.0, beyond)[0] == B8_REC


def test_calm_keeps_a_configuration_that_measured_better_than_the_calm_target() -> None:
    known = measured(b16_rec=1000.0, b8_swap=700.0, b16_swap=1300.0)
    target, reason = decide_on(B16_SWAP, 0.0, known)
    assert target is None and "calm: queue depth 0.0" in reason
    # and from the pressure target, calm goes to it rather than to the calm target
    target, reason = decide_on(B8_SWAP, 0.0, known)
    assert target == B16_SWAP and "16/recompute measured 1000 tok/s over 600 s at capacity against 16/swap's 1300" in reason


def test_calm_returns_to_its_target_when_that_is_unmeasured_or_as_good() -> None:
    assert decide_on(B8_SWAP, 0.0, measured(b8_swap=1300.0))[0] == B16_REC
    assert decide_on(B8_SWAP, 0.0, measured(b16_rec=1000.0, b8_swap=1030.0))[0] == B16_REC


def test_a_measured_configuration_the_spec_no_longer_allows_is_ignored() -> None:
    no_swap = dataclasses.replace(LIMITS, swap_space_gib=0)
    known = measured(b16_rec=1000.0, b16_swap=5000.0)
    assert decide_on(B16_REC, 0.0, known, limits=no_swap)[0] is None
    assert decide_on(B16_REC, 300.0, known, limits=no_swap)[0] == B8_REC
    only_8 = dataclasses.replace(SPEC, allowed_block_sizes=(8,))
    assert decide_on(B8_REC, 300.0, measured(b16_swap=5000.0, b8_rec=100.0), spec=only_8)[0] == B8_SWAP


def test_without_measurements_the_hysteresis_band_holds_whatever_is_in_force() -> None:
    target, reason = decide_on(B8_REC, 70.0, {})
    assert target is None and "block_size 8, recompute stays" in reason


def test_batch_limits_measured_no_better_than_those_in_force_are_not_tried_again() -> None:
    """Memory thrashes: the rule halves max_num_seqs (the only knob free to move), but 128 was
    tried and got through less."""
    halved = dataclasses.replace(B16_REC, max_num_seqs=128)
    thrashing = summary(**at(B16_REC, num_waiting_seqs=300.0, preemptions_per_s=5.0, kv_cache_usage=0.95))
    spec = dataclasses.replace(SPEC, max_num_seqs=KnobRange(64, 256), allowed_block_sizes=(16,),
                               allowed_preemption_modes=("recompute",))
    known = {**measured(b16_rec=1000.0), halved: Estimate(700.0, 0.0, 600.0, 60)}

    def limits(measured_: dict[Knobs, Estimate]) -> tuple[int | None, str]:
        d = decide({"pod-0": thrashing}, config(B16_REC), spec, LIMITS, now=10_000.0, last_change=None,
                   measured=measured_)
        return (None if d.target is None else d.target.max_num_seqs), d.reason
    target, reason = limits(known)
    assert target is None
    assert "max_num_seqs 128, max_num_batched_tokens 2048 measured 700 tok/s over 600 s against 1000 tok/s" in reason
    # unmeasured, or measured better, it is tried
    assert limits(measured(b16_rec=1000.0))[0] == 128
    assert limits({**known, halved: Estimate(1200.0, 0.0, 600.0, 60)})[0] == 128


# --- the switch cost ---

DWELL_10 = dataclasses.replace(SPEC, min_dwell_s=10.0)


def test_a_switch_whose_pause_costs_more_than_its_gain_over_the_dwell_is_not_made() -> None:
    known = measured(b16_rec=1000.0, b8_swap=1100.0)  # +100 tok/s: 1,000 tokens over a 10 s dwell
    assert decide_on(B16_REC, 300.0, known, spec=DWELL_10)[0] == B8_SWAP  # no pause seen yet: free
    target, reason = decide_on(B16_REC, 300.0, known, spec=DWELL_10, pauses=pause(B16_REC, B8_SWAP, 2.0))
    assert target is None
    assert ("switch cost: 8/swap's expected gain 1000 tokens over the 10 s dwell (+100 tok/s) < the 2000 tokens "
            "its 2000 ms pause loses at 1000 tok/s: 16/recompute stays") in reason
    # a longer dwell earns the same pause back
    target, reason = decide_on(B16_REC, 300.0, known, spec=SPEC, pauses=pause(B16_REC, B8_SWAP, 2.0))
    assert target == B8_SWAP and "expected gain 6000 tokens over the 60 s dwell (+100 tok/s) >= the 2000 tokens" \
        in reason


def test_a_short_pause_lets_the_switch_through_with_both_figures_in_the_reason() -> None:
    known = measured(b16_rec=1000.0, b8_swap=1100.0)
    target, reason = decide_on(B16_REC, 300.0, known, spec=DWELL_10, pauses=pause(B16_REC, B8_SWAP, 0.5))
    assert target == B8_SWAP
    assert "switch cost: 8/swap's expected gain 1000 tokens over the 10 s dwell (+100 tok/s) >= the 500 tokens " \
        "its 500 ms pause loses at 1000 tok/s" in reason


def test_the_switch_cost_is_weighed_per_direction_and_only_between_measured_configurations() -> None:
    known = measured(b16_rec=1000.0, b8_swap=1100.0)
    # the pause of the way back says nothing about this way
    target, reason = decide_on(B16_REC, 300.0, known, spec=DWELL_10, pauses=pause(B8_SWAP, B16_REC, 60.0))
    assert target == B8_SWAP and "switch cost" not in reason
    # an unmeasured target is a trial: no gain to weigh, the pause does not stop it
    target, reason = decide_on(B16_REC, 300.0, measured(b16_rec=1000.0), spec=DWELL_10,
                               pauses=pause(B16_REC, B8_SWAP, 60.0))
    assert target == B8_SWAP and "switch cost" not in reason


def test_calm_does_not_pay_a_pause_to_return_to_a_target_that_measured_no_better() -> None:
    known = measured(b16_rec=1000.0, b8_swap=1030.0)  # within the tolerance: calm would go back
    assert decide_on(B8_SWAP, 0.0, known, spec=DWELL_10)[0] == B16_REC
    target, reason = decide_on(B8_SWAP, 0.0, known, spec=DWELL_10, pauses=pause(B8_SWAP, B16_REC, 0.01))
    assert target is None and "16/recompute's expected gain -300 tokens" in reason and "8/swap stays" in reason


# --- kept in status ---

def test_outcomes_and_pauses_go_through_status_and_back_unchanged() -> None:
    o = Outcomes()
    for rate, seconds in ((500.0, 10.0), (700.0, 20.0), (640.0, 5.0)):
        o.observe({"pod-0": summary(block_size=8, mode="swap", duration_s=seconds, num_waiting_seqs=80.0,
                                    prompt_tokens_per_s=rate, generation_tokens_per_s=0.0)}, T)
    o.observe({"pod-0": summary(duration_s=30.0, num_waiting_seqs=80.0, prompt_tokens_per_s=900.0,
                                generation_tokens_per_s=100.0)}, T)
    o.record_pause(B16_REC.engine, B8_SWAP.engine, 0.020)
    o.record_pause(B16_REC.engine, B8_SWAP.engine, 0.040)
    o.record_pause(B8_SWAP.engine, B16_REC.engine, 1.5)
    status = json.loads(json.dumps({"config": {"blockSize": 8}, **o.to_status()}))  # as the API stores it
    assert [(r["blockSize"], r["preemptionMode"], r["maxNumSeqs"], r["maxNumBatchedTokens"], r["windows"])
            for r in status["outcomes"]] == [(8, "swap", 256, 2048, 3), (16, "recompute", 256, 2048, 1)]
    assert (status["outcomes"][1]["promptTokensPerRequest"], status["outcomes"][1]["generatedTokensPerRequest"]) \
        == (135.0, 15.0)  # 900 and 100 tokens/s over 30 s, 200 requests
    assert status["switchPauses"][1] == {"from": {"blockSize": 16, "preemptionMode": "recompute"},
                                         "to": {"blockSize": 8, "preemptionMode": "swap"},
                                         "pauseMs": 30.0, "switches": 2}
    back = Outcomes.from_status(status)
    for target in (B8_SWAP, B16_REC):
        before, after = o.estimate(target), back.estimate(target)
        assert before is not None and after is not None
        assert after.tokens_per_s == pytest.approx(before.tokens_per_s, abs=1e-3)
        assert after.seconds == pytest.approx(before.seconds) and after.num_windows == before.num_windows
        assert after.stderr == pytest.approx(before.stderr, rel=1e-3)  # inf for the single window
        assert after.mix == pytest.approx(before.mix, abs=1e-3)  # rounded as status keeps it
    assert back.pauses() == pytest.approx(o.pauses())
    assert back.to_status() == o.to_status()
    back.record_pause(B16_REC.engine, B8_SWAP.engine, 0.090)  # a restored mean goes on as if never written
    assert back.pauses()[(B16_REC.engine, B8_SWAP.engine)] == pytest.approx(0.050)


def test_an_unreadable_entry_in_status_is_dropped_not_fatal() -> None:
    limits = {"maxNumSeqs": 256, "maxNumBatchedTokens": 2048}
    status = {"outcomes": [{"blockSize": 8, "preemptionMode": "swap", **limits, "tokensPerSecond": 500.0,
                            "spread": 0.0, "seconds": 30.0, "windows": 3},
                           {"blockSize": 12, "preemptionMode": "swap", **limits, "tokensPerSecond": 1.0,
                            "spread": 0.0, "seconds": 30.0, "windows": 3},
                           {"blockSize": 16, "preemptionMode": "recompute", **limits},
                           # written before the batch limits were kept: it may merge several
                           {"blockSize": 16, "preemptionMode": "swap", "tokensPerSecond": 900.0, "spread": 0.0,
                            "seconds": 30.0, "windows": 3}],
              "switchPauses": [{"from": {"blockSize": 8}, "to": {"blockSize": 16, "preemptionMode": "swap"},
                                "pauseMs": 1.0, "switches": 1}]}
    back = Outcomes.from_status(status)
    assert list(back.measured(0.0)) == [B8_SWAP] and back.pauses() == {}
    assert Outcomes.from_status({}).to_status() == {}


def _measured_memory(basis: dict[str, str] | None) -> Outcomes:
    o = Outcomes(basis)
    o.observe({"pod-0": summary(duration_s=30.0, num_waiting_seqs=80.0, prompt_tokens_per_s=900.0,
                                generation_tokens_per_s=100.0)}, T)
    o.record_pause(B16_REC.engine, B8_SWAP.engine, 0.020)
    return o


def test_figures_measured_under_another_basis_are_dropped_and_the_differences_named() -> None:
    o = _measured_memory({"model": "a", "gpus": "1", "image": "x"})
    assert o.rebase({"model": "a", "gpus": "1", "image": "x"}) == [] and list(o.measured(0.0)) == [B16_REC]
    changed = o.rebase({"model": "b", "gpus": "1", "placement": "any node"})
    assert changed == ["image: x -> (unset)", "model: a -> b", "placement: (unset) -> any node"]
    assert o.measured(0.0) == {} and o.pauses() == {} and o.estimate(B16_REC) is None
    status = o.to_status()  # what the status patch sends: None removes the stored entries
    assert status["outcomes"] is None and status["switchPauses"] is None
    assert status["outcomesBasis"] == {"gpus": "1", "model": "b", "placement": "any node"}
    o.observe({"pod-0": summary(duration_s=30.0, num_waiting_seqs=80.0, prompt_tokens_per_s=500.0,
                                generation_tokens_per_s=0.0)}, T)
    status = o.to_status()  # the new figures are written; the pauses stay removed until one is seen
    assert [r["tokensPerSecond"] for r in status["outcomes"]] == [500.0] and status["switchPauses"] is None
    assert Outcomes.from_status(status).rebase(o.basis) == []  # the new figures hold for the new basis


def test_a_memory_without_a_basis_takes_the_current_one_and_keeps_its_figures() -> None:
    legacy = _measured_memory(None).to_status()
    assert "outcomesBasis" not in legacy
    back = Outcomes.from_status(legacy)
    assert back.rebase({"model": "a"}) == [] and list(back.measured(0.0)) == [B16_REC] and back.pauses()
    status = back.to_status()
    assert status["outcomesBasis"] == {"model": "a"} and status["outcomes"] and status["switchPauses"]
    empty = Outcomes({"model": "a"})  # nothing measured: a new basis drops nothing and says nothing
    assert empty.rebase({"model": "b"}) == [] and empty.basis == {"model": "b"}
