"""The one spelling of a time in status, Events and decision records: RFC 3339 in UTC to the
second (`2026-01-01T00:00:00Z`), as Kubernetes writes `metav1.Time`."""

from __future__ import annotations

import time
from datetime import UTC, datetime

_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def iso(t: float) -> str:
    """Seconds since the epoch -> the status spelling."""
    return datetime.fromtimestamp(t, UTC).strftime(_FORMAT)


def now_iso() -> str:
    return iso(time.time())


def epoch(text: str | None) -> float | None:
    """The status spelling -> seconds since the epoch; None for a missing or unreadable time."""
    try:
        return datetime.strptime(text or "", _FORMAT).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None
