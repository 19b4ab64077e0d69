"""Does a live child still hold what the operator built? Compared field by field, not by hash.

`covers(live, desired)` is True when every value `desired` sets is on `live`:

* fields only `live` has are the API server's defaults (`terminationMessagePath`, a Service's
  `clusterIP`) or someone else's additions (labels, `kubectl rollout restart`'s annotation):
  not drift;
* lists are compared item by item (the API server keeps their order): an extra container or
  env var, or a changed image, is drift;
* quantities are compared by value, as the API server rewrites them (`0.5` -> `500m`, `1` -> `"1"`).
"""

from __future__ import annotations

from typing import Any

from kubernetes.utils import parse_quantity


def covers(live: Any, desired: Any) -> bool:
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and covers(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and \
            all(covers(a, b) for a, b in zip(live, desired, strict=True))
    if isinstance(desired, bool) or isinstance(live, bool):
        return live is desired
    return bool(live == desired or _same_quantity(live, desired))


def _same_quantity(a: Any, b: Any) -> bool:
    if not isinstance(a, int | float | str) or not isinstance(b, int | float | str):
        return False
    try:
        return bool(parse_quantity(a) == parse_quantity(b))
    except ValueError:
        return False
