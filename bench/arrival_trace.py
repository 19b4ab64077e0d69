"""Arrival traces: the fleet-wide request rate over time, linear between points.

File format (`--trace FILE`): CSV with the header `time_s,rate` (seconds from the start,
requests/s), or JSON, a list of `{"time_s": t, "rate": r}` objects or `[t, r]` pairs. Times
start at 0 and increase; rates are non-negative.

The built-in trace is a day of chat traffic squeezed into `duration_s`: a night trough, a
morning and an afternoon peak and a smaller evening one, and bursts (a sudden 1.4-2x for 2-10
minutes, on a one-minute rise), at random times of the day from a seed.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DAY_S = 86_400.0


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the row."""


@dataclass(frozen=True)
class Trace:
    times: np.ndarray  # seconds, increasing from 0
    rates: np.ndarray  # requests/s at those times
    description: str

    @property
    def duration_s(self) -> float:
        return float(self.times[-1])

    @property
    def peak(self) -> float:
        return float(self.rates.max())

    def write_csv(self, path: Path) -> None:
        """The `--trace FILE` format, so a built-in trace can be kept, edited and replayed."""
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = "".join(f"{t!r},{r!r}\n" for t, r in zip(self.times.tolist(), self.rates.tolist(), strict=True))
        path.write_text("time_s,rate\n" + rows)

    def tick_rates(self, tick_s: float) -> np.ndarray:
        """The mean rate of each tick of `tick_s` seconds (the rate at its middle, exact for a
        rate linear within the tick)."""
        middles = (np.arange(math.ceil(self.duration_s / tick_s)) + 0.5) * tick_s
        return np.interp(middles, self.times, self.rates)


def day_trace(peak_rate: float, duration_s: float = DAY_S, *, trough: float = 0.15, bursts: int = 8,
              seed: int = 0) -> Trace:
    """A day's shape scaled so that its highest hour (bursts aside) is `peak_rate`."""
    if peak_rate <= 0:
        raise ValueError(f"peak_rate: must be positive, not {peak_rate}")
    if duration_s <= 0:
        raise ValueError(f"duration_s: must be positive, not {duration_s}")
    step = max(duration_s / 8640, 1.0)
    times = np.arange(0.0, duration_s + step / 2, step)
    hours = times / duration_s * 24

    def bump(center: float, width: float) -> np.ndarray:
        return np.exp(-0.5 * ((hours - center) / width) ** 2)

    shape = 0.9 * bump(10.5, 2.2) + bump(15.5, 2.8) + 0.7 * bump(21.0, 1.8)
    rates = peak_rate * (trough + (1 - trough) * shape / shape.max())
    rng = np.random.default_rng(seed)
    scale = duration_s / DAY_S  # burst lengths shrink with a squeezed day
    for _ in range(bursts):
        start = rng.uniform(0.3, 0.95) * duration_s
        height = rng.uniform(0.4, 1.0)
        rise, hold = 60 * scale, rng.uniform(120, 600) * scale
        ramp = np.clip((times - start) / rise, 0, 1) * np.clip(1 - (times - start - rise - hold) / rise, 0, 1)
        rates = rates * (1 + height * ramp)
    return Trace(times, rates, f"built-in day: peak {peak_rate:g} req/s before bursts, trough {trough:.0%} of it, "
                               f"{bursts} bursts, {duration_s:g} s, seed {seed}")


def load_trace(path: Path) -> Trace:
    try:
        text = path.read_text()
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None
    try:
        pairs = _json_pairs(json.loads(text)) if path.suffix == ".json" else _csv_pairs(text)
        times, rates = _check(pairs)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not JSON: {e}") from None
    return Trace(times, rates, f"{path.name}: {len(times)} points over {times[-1]:g} s")


def _csv_pairs(text: str) -> list[tuple[Any, Any]]:
    rows = list(csv.DictReader(text.splitlines()))
    if not rows or not {"time_s", "rate"} <= set(rows[0]):
        raise TraceError("a CSV trace needs the header time_s,rate and at least one row")
    return [(row["time_s"], row["rate"]) for row in rows]


def _json_pairs(body: Any) -> list[tuple[Any, Any]]:
    if not isinstance(body, list):
        raise TraceError("a JSON trace is a list of {time_s, rate} objects or [time_s, rate] pairs")
    pairs = []
    for i, item in enumerate(body):
        if isinstance(item, dict) and {"time_s", "rate"} <= item.keys():
            pairs.append((item["time_s"], item["rate"]))
        elif isinstance(item, list) and len(item) == 2:
            pairs.append((item[0], item[1]))
        else:
            raise TraceError(f"point {i}: expected {{\"time_s\": t, \"rate\": r}} or [t, r], not {item!r}")
    return pairs


def _check(pairs: list[tuple[Any, Any]]) -> tuple[np.ndarray, np.ndarray]:
    times: list[float] = []
    rates: list[float] = []
    for i, (t, r) in enumerate(pairs):
        try:
            time_s, rate = float(t), float(r)
        except (TypeError, ValueError):
            raise TraceError(f"point {i}: time_s and rate must be numbers, not {t!r}, {r!r}") from None
        if not (math.isfinite(time_s) and math.isfinite(rate)) or rate < 0:
            raise TraceError(f"point {i}: rate must be a non-negative number and time_s finite, not {t!r}, {r!r}")
        if (not times and time_s != 0) or (times and time_s <= times[-1]):
            raise TraceError(f"point {i}: times must start at 0 and increase, not {time_s:g} after "
                             f"{times[-1] if times else 'the start'}")
        times.append(time_s)
        rates.append(rate)
    if len(times) < 2:
        raise TraceError("a trace needs at least two points")
    return np.array(times), np.array(rates)
