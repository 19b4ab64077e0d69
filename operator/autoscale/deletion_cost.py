"""Which pod goes on a scale-down: the least loaded, through `controller.kubernetes.io/pod-deletion-cost`.

The ReplicaSet controller removes pods that are not yet scheduled, running or Ready first, then
those of lowest deletion cost. Kept current from the scraped load, the annotation makes the pod
holding the fewest requests the one that drains (preStop, then SIGTERM: it finishes what it
holds), so a scale-down cuts the fewest streams short and waits the least for its drain.

A pod's load is the requests it holds: running, waiting and swapped sequences, window means.
Costs are that load in hundredths of a request. A cost is rewritten only when the load moved
past a band (the larger of `min_change` requests and `min_change_ratio` of the cost written):
loads that close are as good as each other to remove, and a patch on every pod at every scrape
would cost API writes and Events for nothing. Costs apply in every mode, since the Deployment's
ReplicaSet removes the pods whoever set the replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..autotune.window import WindowSummary

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
COST_PER_REQUEST = 100
_MAX_COST = 2**31 - 1  # the annotation is an int32


@dataclass(frozen=True)
class CostBand:
    min_change: float = 2.0  # requests held
    min_change_ratio: float = 0.25

    def __post_init__(self) -> None:
        if self.min_change < 0:
            raise ValueError(f"min_change: must be >= 0, not {self.min_change}")
        if not 0 <= self.min_change_ratio < 1:
            raise ValueError(f"min_change_ratio: must lie in [0, 1), not {self.min_change_ratio}")


def held_requests(summary: WindowSummary) -> float:
    return summary.num_running_seqs + summary.num_waiting_seqs + summary.num_swapped_seqs


def deletion_costs(summaries: Mapping[str, WindowSummary], annotations: Mapping[str, str | None],
                   band: CostBand = CostBand()) -> dict[str, int]:
    """The costs to write, by pod: pods with a window whose annotation is absent, not an integer,
    or farther from their load than the band. `annotations`: each pod's current value, if any."""
    changes = {}
    for pod, summary in summaries.items():
        cost = min(_MAX_COST, round(held_requests(summary) * COST_PER_REQUEST))
        written = _parse(annotations.get(pod))
        if written is None or _outside_band(cost, written, band):
            changes[pod] = cost
    return changes


def cost_patch(cost: int) -> dict[str, object]:
    """The merge patch of one pod."""
    return {"metadata": {"annotations": {DELETION_COST_ANNOTATION: str(cost)}}}


def _outside_band(cost: int, written: int, band: CostBand) -> bool:
    allowed = max(band.min_change * COST_PER_REQUEST, band.min_change_ratio * abs(written))
    return abs(cost - written) > allowed


def _parse(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
