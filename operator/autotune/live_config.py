"""The engine's live tunables as the operator sees them, and the fixed facts that bound them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

BLOCK_SIZES = (8, 16, 32, 64)
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULER_POLICIES = ("fcfs", "fair", "priority")
_CAMEL = {"block_size": "blockSize", "preemption_mode": "preemptionMode", "max_num_seqs": "maxNumSeqs",
          "max_num_batched_tokens": "maxNumBatchedTokens", "scheduler_policy": "schedulerPolicy"}


@dataclass(frozen=True)
class LiveConfig:
    """What `POST /admin/config` changes on a running engine, as `GET /admin/config` reports it."""

    block_size: int
    preemption_mode: str
    max_num_seqs: int
    max_num_batched_tokens: int
    scheduler_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size: {self.block_size} is not one of {BLOCK_SIZES}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: {self.preemption_mode!r} is not one of {PREEMPTION_MODES}")
        if self.scheduler_policy not in SCHEDULER_POLICIES:
            raise ValueError(f"scheduler_policy: {self.scheduler_policy!r} is not one of {SCHEDULER_POLICIES}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, not {getattr(self, name)}")

    @classmethod
    def from_engine(cls, config: Mapping[str, Any]) -> LiveConfig:
        """From the engine's `GET /admin/config` (or the `config` of a POST's answer)."""
        try:
            return cls(**{name: config[name] for name in cls.__dataclass_fields__})
        except KeyError as e:
            raise ValueError(f"{e.args[0]}: missing from the engine's config {dict(config)}") from None

    def to_status(self) -> dict[str, Any]:
        """`status.tuning.config`'s spelling (the CRD's camelCase)."""
        return {_CAMEL[name]: value for name, value in asdict(self).items()}

    @classmethod
    def from_status(cls, config: Mapping[str, Any] | None) -> LiveConfig | None:
        """What `to_status` wrote; None for a missing or unreadable one."""
        try:
            return cls(**{name: (config or {})[camel] for name, camel in _CAMEL.items()})
        except (KeyError, TypeError, ValueError):
            return None

    def changes_to(self, target: LiveConfig) -> dict[str, int | str]:
        """The body of the `POST /admin/config` that turns this config into `target`."""
        mine = asdict(self)
        return {name: value for name, value in asdict(target).items() if mine[name] != value}


@dataclass(frozen=True)
class EngineLimits:
    """Facts of the pods' engine that bound the tunables; they come from the pod spec (the
    `kvpilot serve` flags), not from metrics, and change only with a rollout."""

    swap_space_gib: float  # --swap-space; 0 means a swap preemption has nowhere to go
    max_model_len: int  # --max-model-len
    enable_chunked_prefill: bool  # without it, max_num_batched_tokens >= max_model_len

    def __post_init__(self) -> None:
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib: must be >= 0, not {self.swap_space_gib}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1, not {self.max_model_len}")

    @property
    def min_batched_tokens(self) -> int:
        return 1 if self.enable_chunked_prefill else self.max_model_len
