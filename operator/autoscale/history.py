"""The service's decision history: tuning and scaling in one bounded list in `status.decisions`.

Each entry: `time` (RFC 3339), `kind` (scale | tune), `from` and `to` (replicas, or the engine
config), `reason` (the metric values behind it, as the policy wrote it) and `metrics` (the
values by name). Oldest first; the oldest go once there are more than `HISTORY_LIMIT`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvpilot.runtime.tunables import LiveConfig

from ..autotune.policy import Decision
from ..autotune.tuning_spec import Knobs
from ..timestamps import iso
from .policy import ScaleDecision

HISTORY_LIMIT = 20
# status is stored in etcd with the object; a reason that long has been cut short already
MAX_REASON_CHARS = 1024


@dataclass(frozen=True)
class DecisionRecord:
    time: float  # seconds since the epoch
    kind: Literal["scale", "tune"]
    before: str
    after: str
    reason: str
    metrics: Mapping[str, float] = field(default_factory=dict)

    def to_status(self) -> dict[str, Any]:
        reason = self.reason if len(self.reason) <= MAX_REASON_CHARS else self.reason[:MAX_REASON_CHARS - 1] + "…"
        return {"time": iso(self.time), "kind": self.kind,
                "from": self.before, "to": self.after, "reason": reason,
                "metrics": {name: round(value, 6) for name, value in self.metrics.items()}}


def scale_record(decision: ScaleDecision) -> DecisionRecord:
    metrics: dict[str, float] = {"target": decision.target}
    if decision.value is not None:
        metrics[decision.metric] = decision.value
    if decision.forecast is not None:
        metrics["arrivalRate"] = decision.forecast.rate_now
        metrics["forecastRate"] = decision.forecast.rate_ahead
    return DecisionRecord(decision.time, "scale", str(decision.current), str(decision.desired), decision.reason,
                          metrics)


def tune_record(decision: Decision, now: float) -> DecisionRecord:
    """A tuning decision that changes the config (`decision.target` set)."""
    if decision.target is None:
        raise ValueError("decision: holds the config in force; only changes go to the history")
    s = decision.signals
    metrics = {} if s is None else {
        name: value for name, value in (
            ("queueDepth", s.queue_depth), ("kvCacheUsage", s.kv_cache_usage),
            ("preemptionsPerSecond", s.preemptions_per_s), ("ttftP99Seconds", s.ttft_p99_s),
            ("itlP99Seconds", s.itl_p99_s), ("goodputPerSecond", s.goodput_per_s)) if value is not None}
    return DecisionRecord(now, "tune", _config(decision.current), _config(decision.target), decision.reason, metrics)


def appended(entries: Sequence[Mapping[str, Any]], record: DecisionRecord,
             limit: int = HISTORY_LIMIT) -> list[dict[str, Any]]:
    """`status.decisions` with `record` added last and the oldest past `limit` dropped."""
    if limit < 1:
        raise ValueError(f"limit: must be >= 1, not {limit}")
    return [*map(dict, entries), record.to_status()][-limit:]


def _config(config: LiveConfig) -> str:
    return str(Knobs.of(config))
