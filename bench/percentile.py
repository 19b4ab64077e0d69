"""The one percentile of every benchmark table: numpy's default ("linear", Hyndman and Fan's type
7), the definition vLLM's serving benchmark reports, so a P99 here reads as one there. Between two
ordered values it interpolates: the P50 of [1, 2, 3, 4] is 2.5, the P99 of 1..100 is 99.01."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (q in [0, 100]) of `values`, which must not be empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must lie in [0, 100], not {q}")
    array = np.asarray(values, dtype=np.float64)
    if not array.size:
        raise ValueError("percentile: no values")
    return float(np.percentile(array, q))
