"""Service-level objectives: `--slo ttft=500ms,itl=50ms,e2e=10s`, per-request attainment
(goodput) and the run-level check `--search` uses.

A request meets the SLO when it finished, its TTFT is within `ttft`, its mean gap between tokens
within `itl` (vLLM's goodput judges TPOT the same way) and its end-to-end latency within `e2e`;
goodput is such requests per second. A run meets the SLO when the P99 of each named latency over
all requests is within its limit and no request failed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .loadgen import RequestResult

KEYS = ("ttft", "itl", "e2e")
_UNITS = {"ms": 1e-3, "s": 1.0}
_VALUE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)\s*$")


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        if all(getattr(self, f"{k}_s") is None for k in KEYS):
            raise ValueError("slo: name at least one of ttft, itl, e2e")

    def limits(self) -> dict[str, float]:
        return {k: v for k in KEYS if (v := getattr(self, f"{k}_s")) is not None}

    def met_by(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft_s is None or r.e2e_s is None:
            return False
        mean_itl = sum(r.itls_s) / len(r.itls_s) if r.itls_s else 0.0
        observed = {"ttft": r.ttft_s, "itl": mean_itl, "e2e": r.e2e_s}
        return all(observed[k] <= limit for k, limit in self.limits().items())

    def describe(self) -> str:
        return ",".join(f"{k}={1000 * v:g}ms" for k, v in self.limits().items())


def parse_slo(text: str) -> Slo:
    """`ttft=500ms,itl=50ms` -> Slo; ValueError names the part that is wrong."""
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in KEYS:
            raise ValueError(f"slo: {part.strip()!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)}")
        if key in values:
            raise ValueError(f"slo: {key} is given twice")
        match = _VALUE.match(raw)
        if not match:
            raise ValueError(f"slo: {key}={raw.strip()!r} needs a duration with a unit, such as 500ms or 2s")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
        if not seconds > 0 or not math.isfinite(seconds):
            raise ValueError(f"slo: {key} must be a positive duration, not {raw.strip()!r}")
        values[key] = seconds
    return Slo(**{f"{k}_s": v for k, v in values.items()})
