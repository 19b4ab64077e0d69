"""`kvpilot bench autotune`'s workload: phases, each with its own arrival process and lengths.

YAML (`--workload FILE`):

    phases:
      - name: calm            # shown in the table and the plot
        duration: 60          # seconds
        rate: 2               # requests/s
        burstiness: 1         # Gamma shape of the gaps: 1 Poisson (default), < 1 bursty
        input_len: 128        # mean prompt tokens
        output_len: 64        # mean output tokens
        range_ratio: 0.5      # lengths uniform within len * (1 +- ratio) (default 0)
        prefix_share: 0.0     # share of the phase's requests that start with a shared prefix (default 0)
        prefix_len: 0         # that prefix's tokens

Requests and arrivals come from one seed, so every configuration sees the same requests at the
same times. The built-in workloads follow the issue's story: calm short chats; a burst that
queues far more requests than the engine runs at once; long prompts with long outputs.
`DEFAULT` is sized for one H200 with the Llama-3-8B shape; `QUICK` for a CI run on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from .loadgen import arrival_times
from .workload import DEFAULT_TOKEN_RANGE, BenchRequest, sampled_lengths


class WorkloadFileError(ValueError):
    """A workload file that cannot be used; the message names the phase and the field."""


@dataclass(frozen=True)
class Phase:
    name: str
    duration: float
    rate: float
    input_len: int
    output_len: int
    burstiness: float = 1.0
    range_ratio: float = 0.0
    prefix_share: float = 0.0
    prefix_len: int = 0

    def __post_init__(self) -> None:
        checks = [(self.duration > 0, "duration", "must be positive"), (self.rate > 0, "rate", "must be positive"),
                  (self.input_len >= 1, "input_len", "must be >= 1"), (self.output_len >= 1, "output_len", "must be >= 1"),
                  (self.burstiness > 0, "burstiness", "must be positive"),
                  (0 <= self.range_ratio < 1, "range_ratio", "must lie in [0, 1)"),
                  (0 <= self.prefix_share <= 1, "prefix_share", "must lie in [0, 1]"),
                  (self.prefix_len >= 0, "prefix_len", "must be >= 0"),
                  (self.prefix_share == 0 or self.prefix_len > 0, "prefix_len", "must be > 0 when prefix_share is")]
        for ok, name, rule in checks:
            if not ok:
                raise WorkloadFileError(f"phase {self.name!r}: {name} {rule}, not {getattr(self, name)!r}")

    @property
    def max_tokens(self) -> int:
        """The longest request's prompt plus output."""
        return self.prefix_len + math.ceil(self.input_len * (1 + self.range_ratio)) + \
            math.ceil(self.output_len * (1 + self.range_ratio))


DEFAULT = (
    Phase("calm", 90, 4.0, 256, 128, range_ratio=0.5),
    Phase("burst", 30, 40.0, 512, 256, burstiness=0.5, range_ratio=0.25),
    Phase("long", 120, 1.5, 2048, 1024, range_ratio=0.25, prefix_share=0.5, prefix_len=512),
)
QUICK = (
    Phase("calm", 12, 0.7, 24, 12, range_ratio=0.5),
    Phase("burst", 6, 8.0, 48, 32, burstiness=0.5, range_ratio=0.25),
    Phase("long", 14, 0.5, 160, 64, range_ratio=0.25, prefix_share=0.5, prefix_len=32),
)


@dataclass(frozen=True)
class TimedRequest:
    phase: int  # index into the phases
    at: float  # send time, seconds from the run's start
    request: BenchRequest


def load_phases(path: Path) -> tuple[Phase, ...]:
    import yaml

    try:
        body = yaml.safe_load(path.read_text())
    except OSError as e:
        raise WorkloadFileError(f"--workload {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise WorkloadFileError(f"--workload {path}: not YAML: {e}") from None
    phases = body.get("phases") if isinstance(body, dict) else None
    if not isinstance(phases, list) or not phases:
        raise WorkloadFileError(f"--workload {path}: expected 'phases:', a non-empty list")
    return tuple(_phase(path, i, entry) for i, entry in enumerate(phases))


def _phase(path: Path, i: int, entry: Any) -> Phase:
    where = f"--workload {path}, phase {i + 1}"
    if not isinstance(entry, dict):
        raise WorkloadFileError(f"{where}: expected a mapping of phase fields")
    known = {f.name for f in fields(Phase)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise WorkloadFileError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    entry = {"name": f"phase-{i + 1}", **entry}
    missing = [name for name in ("duration", "rate", "input_len", "output_len") if name not in entry]
    if missing:
        raise WorkloadFileError(f"{where}: missing {', '.join(missing)}")
    try:
        typed = {name: (str(v) if name == "name" else int(v) if name in ("input_len", "output_len", "prefix_len")
                        else float(v)) for name, v in entry.items()}
    except (TypeError, ValueError) as e:
        raise WorkloadFileError(f"{where}: {e}") from None
    try:
        return Phase(**typed)  # type: ignore[arg-type]
    except WorkloadFileError as e:
        raise WorkloadFileError(f"{where}: {e}") from None


def build_requests(phases: tuple[Phase, ...], seed: int = 0) -> list[TimedRequest]:
    """Every phase's requests with their send times, in time order."""
    rng = np.random.default_rng(seed)
    low, high = DEFAULT_TOKEN_RANGE
    out: list[TimedRequest] = []
    start = 0.0
    for index, phase in enumerate(phases):
        expected = phase.rate * phase.duration
        times = arrival_times(int(expected * 2 + 20), phase.rate, phase.burstiness, rng)
        times = times[times < phase.duration]
        prefix = rng.integers(low, high, size=phase.prefix_len).tolist()
        inputs = sampled_lengths(rng, len(times), phase.input_len, phase.range_ratio)
        outputs = sampled_lengths(rng, len(times), phase.output_len, phase.range_ratio)
        shared = rng.random(len(times)) < phase.prefix_share
        for at, n_in, n_out, with_prefix in zip(times.tolist(), inputs.tolist(), outputs.tolist(), shared.tolist(),
                                                strict=True):
            ids = (prefix if with_prefix else []) + rng.integers(low, high, size=n_in).tolist()
            out.append(TimedRequest(index, start + at, BenchRequest(ids, len(ids), n_out)))
        start += phase.duration
    return out


def phase_bounds(phases: tuple[Phase, ...]) -> list[tuple[float, float]]:
    bounds, start = [], 0.0
    for phase in phases:
        bounds.append((start, start + phase.duration))
        start += phase.duration
    return bounds
