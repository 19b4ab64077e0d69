"""Scale-down without losses and without fights: pod-deletion-cost follows the load with a band,
the autotuner and the autoscaler take turns, and both land in one bounded history."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest
from autotune_fixtures import summary

from kvpilot.operator.autoscale import (
    DELETION_COST_ANNOTATION,
    Coordination,
    CostBand,
    ScalerState,
    ScalingSpec,
    appended,
    cost_patch,
    decide_replicas,
    deletion_costs,
    scale_record,
    tune_record,
)
from kvpilot.operator.autotune import EngineLimits, LiveConfig, TuningSpec, WindowSummary, decide

BASE = summary()


def loaded(pod: str, running: float, waiting: float = 0.0) -> WindowSummary:
    return dataclasses.replace(BASE, pod=pod, num_running_seqs=running, num_waiting_seqs=waiting)


def test_the_least_loaded_pod_gets_the_lowest_cost() -> None:
    costs = deletion_costs({"a": loaded("a", 30.0, 5.0), "b": loaded("b", 2.5), "c": loaded("c", 12.0)}, {})
    assert costs == {"a": 3500, "b": 250, "c": 1200}
    assert min(costs, key=costs.__getitem__) == "b"


def test_swapped_sequences_count_as_held() -> None:
    costs = deletion_costs({"a": dataclasses.replace(loaded("a", 4.0), num_swapped_seqs=3.0)}, {})
    assert costs == {"a": 700}


def test_costs_within_the_band_are_not_rewritten() -> None:
    written = {"a": "3000", "b": "1000"}
    # a: 31 held (band max(2, 25% of 30) = 7.5 requests); b: 11.5 held (band max(2, 2.5) = 2.5)
    assert deletion_costs({"a": loaded("a", 31.0), "b": loaded("b", 11.5)}, written) == {}


def test_costs_follow_a_load_that_moved_past_the_band() -> None:
    written = {"a": "3000", "b": "1000"}
    changes = deletion_costs({"a": loaded("a", 4.0), "b": loaded("b", 40.0)}, written)
    assert changes == {"a": 400, "b": 4000}


def test_a_small_load_moves_by_the_absolute_band() -> None:
    assert deletion_costs({"a": loaded("a", 2.9)}, {"a": "100"}) == {}
    assert deletion_costs({"a": loaded("a", 3.5)}, {"a": "100"}) == {"a": 350}


def test_load_that_jitters_between_scrapes_writes_no_annotation() -> None:
    written: dict[str, str | None] = {}
    writes = 0
    for step in range(100):
        windows = {"a": loaded("a", 20.0 + (step % 5)), "b": loaded("b", 6.0 + (step % 3) * 0.5)}
        changes = deletion_costs(windows, written)
        writes += len(changes)
        written.update({pod: str(cost) for pod, cost in changes.items()})
    assert writes == 2  # the first annotation of each pod


def test_a_missing_or_foreign_annotation_is_written() -> None:
    windows = {"a": loaded("a", 4.0), "b": loaded("b", 4.0)}
    assert deletion_costs(windows, {"a": None, "b": "not-a-number"}) == {"a": 400, "b": 400}


def test_pods_without_a_window_are_left_alone() -> None:
    assert deletion_costs({"a": loaded("a", 4.0)}, {"a": "400", "b": "999"}) == {}


def test_the_patch_sets_the_annotation_as_a_string() -> None:
    assert cost_patch(250) == {"metadata": {"annotations": {DELETION_COST_ANNOTATION: "250"}}}
    assert DELETION_COST_ANNOTATION == "controller.kubernetes.io/pod-deletion-cost"


def test_a_bad_band_names_the_field() -> None:
    with pytest.raises(ValueError, match="min_change_ratio: must lie in"):
        CostBand(min_change_ratio=1.5)


def test_a_scale_event_pauses_tuning_for_the_dwell() -> None:
    c = Coordination().scaled(1000.0)
    turn = c.may_tune(1100.0, dwell_s=300)
    assert not turn.allowed and turn.reason == "scaled 100 s ago: tuning waits 300 s for windows at the new load"
    assert c.may_tune(1300.0, dwell_s=300).allowed


def test_scale_down_waits_while_a_tuning_change_is_judged_and_for_the_dwell_after() -> None:
    c = Coordination().tuning_started()
    assert not c.may_scale("down", 1000.0, dwell_s=300).allowed
    assert "being judged" in c.may_scale("down", 1000.0, dwell_s=300).reason
    settled = c.tuning_settled(1000.0)
    assert not settled.may_scale("down", 1200.0, dwell_s=300).allowed
    assert settled.may_scale("down", 1300.0, dwell_s=300).allowed


def test_scale_up_never_waits() -> None:
    c = Coordination().tuning_started()
    assert c.may_scale("up", 1000.0, dwell_s=300).allowed
    assert c.tuning_settled(999.0).may_scale("up", 1000.0, dwell_s=300).allowed


def test_one_pass_changes_either_the_replicas_or_the_config() -> None:
    """The operator's pass: scaling first; when it scaled, tuning waits, though it wanted to act."""
    pressured = dataclasses.replace(BASE, num_waiting_seqs=150.0, num_requests_waiting=150.0)
    windows = {"pod-0": pressured, "pod-1": dataclasses.replace(pressured, pod="pod-1")}
    scaling = ScalingSpec(enabled=True, metric="waitingPerReplica", target=50, max_replicas=8)
    scale = decide_replicas(windows, {"pod-0": "ready", "pod-1": "ready"}, 2, scaling, ScalerState(), now=1000.0)
    tune = decide(windows, LiveConfig(16, "recompute", 256, 2048), TuningSpec(enabled=True),
                  EngineLimits(4, 2048, True), now=1000.0, last_change=None)
    assert scale.direction == "up" and tune.target is not None  # both want to act
    c = Coordination()
    assert c.may_scale("up", 1000.0, dwell_s=300).allowed
    c = c.scaled(1000.0)
    assert not c.may_tune(1000.0, dwell_s=300).allowed


def test_both_kinds_of_decision_share_one_bounded_history() -> None:
    pressured = dataclasses.replace(BASE, num_waiting_seqs=150.0, num_requests_waiting=150.0)
    spec = ScalingSpec(enabled=True, metric="waitingPerReplica", target=50, max_replicas=8)
    scale = decide_replicas({"pod-0": pressured}, {"pod-0": "ready"}, 1, spec, ScalerState(), now=1_700_000_000.0)
    tune = decide({"pod-0": pressured}, LiveConfig(16, "recompute", 256, 2048), TuningSpec(enabled=True),
                  EngineLimits(4, 2048, True), now=1_700_000_060.0, last_change=None)
    history = appended([], scale_record(scale))
    history = appended(history, tune_record(tune, 1_700_000_060.0))
    assert [(h["kind"], h["from"], h["to"]) for h in history] == [
        ("scale", "1", "3"),
        ("tune", "block_size 16, recompute, max_num_seqs 256, max_num_batched_tokens 2048",
         "block_size 8, swap, max_num_seqs 256, max_num_batched_tokens 2048")]
    assert history[0]["time"] == datetime.fromtimestamp(1_700_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert history[0]["metrics"] == {"waitingPerReplica": 150.0, "target": 50.0}
    assert history[0]["reason"].startswith("waitingPerReplica 150.0 (mean of 1 ready pod) vs target 50.0")
    assert history[1]["metrics"]["queueDepth"] == 150.0 and "queue depth 150.0 > 100" in history[1]["reason"]
    for _ in range(30):
        history = appended(history, scale_record(scale), limit=20)
    assert len(history) == 20 and history[-1]["kind"] == "scale" and all(h["kind"] == "scale" for h in history)


def test_a_hold_is_not_a_tuning_change() -> None:
    hold = decide({"pod-0": BASE}, LiveConfig(16, "recompute", 256, 2048), TuningSpec(enabled=True),
                  EngineLimits(4, 2048, True), now=1000.0, last_change=None)
    with pytest.raises(ValueError, match="decision: holds the config in force"):
        tune_record(hold, 1000.0)
