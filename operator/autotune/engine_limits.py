"""The fixed facts of the pods' engine that bound the live tunables (the tunables themselves, and
`LiveConfig`, are the runtime's contract: `kvpilot.runtime.tunables`)."""

from __future__ import annotations

from dataclasses import dataclass


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
