"""A service's start-up, read from its pods' creation time and Ready condition: each pod counted
once, a restarted one not at all, the median of the recent ones kept across operator restarts."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.autoscale.startup import RECENT, PodStartup, Startup, pod_startup
from kvpilot.operator.pilot import classify


def pod(name: str, created: str, ready: str | None, restarts: int = 0, **meta: Any) -> dict[str, Any]:
    conditions = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": created}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": "True", "lastTransitionTime": ready})
    return {"metadata": {"name": name, "creationTimestamp": created, **meta},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": conditions,
                       "containerStatuses": [{"name": "server", "restartCount": restarts}]}}


def test_a_ready_pods_start_up_is_its_ready_time_less_its_creation() -> None:
    p = pod_startup(pod("a", "2026-12-07T10:00:00Z", "2026-12-07T10:00:42Z"))
    assert p is not None and (p.pod, p.seconds) == ("a", 42.0)


@pytest.mark.parametrize("manifest", [
    pod("starting", "2026-12-07T10:00:00Z", None),
    pod("restarted", "2026-12-07T10:00:00Z", "2026-12-07T10:09:00Z", restarts=1),
    pod("leaving", "2026-12-07T10:00:00Z", "2026-12-07T10:00:42Z", deletionTimestamp="2026-12-07T11:00:00Z"),
    pod("garbled", "yesterday", "2026-12-07T10:00:42Z"),
    pod("backwards", "2026-12-07T10:00:42Z", "2026-12-07T10:00:00Z"),
])
def test_pods_that_say_nothing_of_a_start_up_are_left_out(manifest: dict[str, Any]) -> None:
    assert pod_startup(manifest) is None


def test_classify_measures_the_ready_pods() -> None:
    pods = classify([pod("a", "2026-12-07T10:00:00Z", "2026-12-07T10:00:30Z"),
                     pod("b", "2026-12-07T10:01:00Z", None)])
    assert [(p.pod, p.seconds) for p in pods.startups] == [("a", 30.0)]


def test_each_pod_counts_once_and_the_median_of_the_recent_ones_is_kept() -> None:
    a, b = PodStartup("a", 1000.0, 40.0), PodStartup("b", 1100.0, 60.0)
    s = Startup().measured([a]).measured([a, b]).measured([b, a])
    assert (s.recent, s.seconds, s.last_ready_time) == ((40.0, 60.0), 50.0, 1100.0)
    many = s.measured(PodStartup(f"p{i}", 2000.0 + i, float(i)) for i in range(20))
    assert many.recent == tuple(float(i) for i in range(20 - RECENT, 20))


def test_the_status_round_trip_keeps_a_restarted_operator_from_counting_a_pod_twice() -> None:
    s = Startup().measured([PodStartup("a", 1765101642.0, 41.5), PodStartup("b", 1765101700.0, 38.0)])
    status = s.to_status()
    assert status == {"seconds": 39.8, "recent": [41.5, 38.0], "lastReadyTime": "2025-12-07T10:01:40Z"}
    again = Startup.from_status(status)
    assert again == s and again.measured([PodStartup("b", 1765101700.0, 38.0)]) == s
    assert Startup().to_status() == {} and Startup.from_status({}) == Startup()
