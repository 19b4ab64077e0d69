"""What the autotuner may do, and when: the operator's form of `spec.autotune`.

Every field maps to one CRD field under `spec.autotune` (named beside it); durations are
seconds here and Kubernetes-style strings (`60s`, `10m`) in the CRD. The defaults are the
starting rule kvpilot was built to test: every 60 s, a queue over 100 requests switches to
block size 8 with swap, otherwise 16 with recompute; the rest only adds to it (hysteresis,
cooldown, dwell, preemption rate, context length, SLO targets, batch limits, a canary).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kvpilot.runtime.tunables import (
    BLOCK_SIZE,
    BLOCK_SIZES,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PREEMPTION_MODE,
    PREEMPTION_MODES,
    LiveConfig,
    Tunable,
)


@dataclass(frozen=True)
class EngineTarget:
    """A block size and preemption mode the policy moves the service to."""

    block_size: int
    preemption_mode: str

    def __post_init__(self) -> None:
        BLOCK_SIZE.check(self.block_size)
        PREEMPTION_MODE.check(self.preemption_mode)


# The tunables the autotuner moves: what each pod is checked to run and what a measured capacity
# belongs to. The scheduler policy is the spec's, never tuned.
TUNED: tuple[Tunable, ...] = (BLOCK_SIZE, PREEMPTION_MODE, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)


@dataclass(frozen=True)
class Knobs:
    """The values of the `TUNED` tunables (fields named as the contract names them, in its order)."""

    block_size: int
    preemption_mode: str
    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        for t in TUNED:
            t.check(getattr(self, t.name))

    @classmethod
    def of(cls, config: LiveConfig) -> Knobs:
        return cls(*(getattr(config, t.name) for t in TUNED))

    @property
    def engine(self) -> EngineTarget:
        return EngineTarget(self.block_size, self.preemption_mode)

    def with_engine(self, engine: EngineTarget) -> Knobs:
        return replace(self, block_size=engine.block_size, preemption_mode=engine.preemption_mode)

    def to_status(self) -> dict[str, Any]:
        """The CRD's spelling (status.tuning.pods, status.tuning.outcomes)."""
        return {t.camel: getattr(self, t.name) for t in TUNED}

    @classmethod
    def from_status(cls, row: Mapping[str, Any]) -> Knobs:
        """What `to_status` wrote; KeyError or ValueError for a row that lacks one or holds a bad one."""
        return cls(*(row[t.camel] for t in TUNED))

    def __str__(self) -> str:
        return (f"block_size {self.block_size}, {self.preemption_mode}, max_num_seqs {self.max_num_seqs}, "
                f"max_num_batched_tokens {self.max_num_batched_tokens}")

    def differences(self, other: Knobs) -> str:
        """Each knob where `self` differs from `other`, as "name mine (not theirs)"."""
        return ", ".join(f"{t.name} {getattr(self, t.name)} (not {getattr(other, t.name)})" for t in TUNED
                         if getattr(self, t.name) != getattr(other, t.name))


@dataclass(frozen=True)
class Thresholds:
    """Levels on per-pod window means. Pressure is entered above a `*_high` level and left only
    once every signal is below its `*_low` level: the gap is the hysteresis."""

    queue_depth_high: float = 100  # thresholds.queueDepthHigh: waiting sequences
    queue_depth_low: float = 50  # thresholds.queueDepthLow
    preemptions_per_s_high: float = 1.0  # thresholds.preemptionsPerSecondHigh
    preemptions_per_s_low: float = 0.1  # thresholds.preemptionsPerSecondLow
    kv_cache_usage_high: float = 0.9  # thresholds.kvCacheUsageHigh: memory binds
    kv_cache_usage_low: float = 0.3  # thresholds.kvCacheUsageLow: memory is not what binds
    # thresholds.swapMinContextTokens: a preempted sequence this long or longer is cheaper to
    # swap than to prefill again (the crossover is hardware-specific); 0 swaps whatever the length
    swap_min_context_tokens: int = 0

    def __post_init__(self) -> None:
        for low, high in (("queue_depth_low", "queue_depth_high"),
                          ("preemptions_per_s_low", "preemptions_per_s_high"),
                          ("kv_cache_usage_low", "kv_cache_usage_high")):
            if not 0 <= getattr(self, low) <= getattr(self, high):
                raise ValueError(f"{low}: must lie in [0, {high}], not {getattr(self, low)}")
        if self.kv_cache_usage_high > 1:
            raise ValueError(f"kv_cache_usage_high: a ratio, must be <= 1, not {self.kv_cache_usage_high}")
        if self.swap_min_context_tokens < 0:
            raise ValueError(f"swap_min_context_tokens: must be >= 0, not {self.swap_min_context_tokens}")


@dataclass(frozen=True)
class SloTargets:
    """P99 latency targets; a request meets the SLO when its TTFT is within `ttft_p99_s`."""

    ttft_p99_s: float | None = None  # slo.ttftP99Seconds
    itl_p99_s: float | None = None  # slo.itlP99Seconds

    def __post_init__(self) -> None:
        for name in ("ttft_p99_s", "itl_p99_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}: must be positive, not {value}")


@dataclass(frozen=True)
class KnobRange:
    """Bounds for an integer tunable the policy may move (doubling or halving it)."""

    min: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max:
            raise ValueError(f"min: must lie in [1, max={self.max}], not {self.min}")

    def clamp(self, value: int) -> int:
        return max(self.min, min(self.max, value))


@dataclass(frozen=True)
class CanarySpec:
    """A change goes to one pod first and is judged against the others (or, alone, against its
    own window before the change) on goodput and P99 latency."""

    window_s: float = 300  # canary.window: observe at least this long
    timeout_s: float = 900  # canary.timeout: roll back if there is still too little traffic
    min_requests: int = 100  # canary.minRequests: finished requests needed on each side
    tolerance: float = 0.05  # canary.tolerance: relative change that counts as noise

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError(f"window_s: must be positive, not {self.window_s}")
        if self.timeout_s < self.window_s:
            raise ValueError(f"timeout_s: must be >= window_s ({self.window_s}), not {self.timeout_s}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests: must be >= 1, not {self.min_requests}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance: must lie in [0, 1), not {self.tolerance}")


@dataclass(frozen=True)
class TuningSpec:
    """`spec.autotune` of an InferenceService, with the CRD field of each setting."""

    enabled: bool = False  # enabled
    interval_s: float = 60  # interval: scrape and decide this often
    apply: Literal["live", "rollout"] = "live"  # apply: POST /admin/config, or the Deployment's flags
    allowed_block_sizes: tuple[int, ...] = (8, 16, 32)  # allowedBlockSizes
    allowed_preemption_modes: tuple[str, ...] = PREEMPTION_MODES  # allowedPreemptionModes
    pressure: EngineTarget = EngineTarget(8, "swap")  # pressure.{blockSize,preemptionMode}
    calm: EngineTarget = EngineTarget(16, "recompute")  # calm.{blockSize,preemptionMode}
    thresholds: Thresholds = field(default_factory=Thresholds)  # thresholds
    slo: SloTargets = field(default_factory=SloTargets)  # slo
    max_num_seqs: KnobRange | None = None  # maxNumSeqs.{min,max}: absent, never changed
    max_num_batched_tokens: KnobRange | None = None  # maxNumBatchedTokens.{min,max}
    cooldown_s: float = 600  # cooldown: least time between two changes (rollbacks included)
    min_dwell_s: float = 60  # minDwell: a decision needs this much data under the config in force
    canary: CanarySpec = field(default_factory=CanarySpec)  # canary

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s: must be positive, not {self.interval_s}")
        if self.apply not in ("live", "rollout"):
            raise ValueError(f"apply: must be live or rollout, not {self.apply!r}")
        if not self.allowed_block_sizes or not set(self.allowed_block_sizes) <= set(BLOCK_SIZES):
            raise ValueError(f"allowed_block_sizes: must be a non-empty subset of {BLOCK_SIZES}, "
                             f"not {self.allowed_block_sizes}")
        if not self.allowed_preemption_modes or not set(self.allowed_preemption_modes) <= set(PREEMPTION_MODES):
            raise ValueError(f"allowed_preemption_modes: must be a non-empty subset of {PREEMPTION_MODES}, "
                             f"not {self.allowed_preemption_modes}")
        for name in ("cooldown_s", "min_dwell_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, not {getattr(self, name)}")

    @property
    def window_span_s(self) -> float:
        """How long each pod's window must keep samples: the dwell for the policy; for a canary
        alone, its own window before the change plus the longest it may run after it."""
        return max(self.min_dwell_s, self.canary.window_s + self.canary.timeout_s) + self.interval_s
