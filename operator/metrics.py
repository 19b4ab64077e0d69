"""The operator's own Prometheus metrics (its pods' metrics are the runtime's)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

RECONCILES = Counter("kvpilot_operator_reconciles", "InferenceService reconciles by result",
                     ["result"])  # success | retry | conflict | failed
API_ERRORS = Counter("kvpilot_operator_api_errors", "Kubernetes API errors by HTTP status (0: unreachable)",
                     ["status"])
CHILD_CHANGES = Counter("kvpilot_operator_child_changes", "Children written, by kind and action",
                        ["kind", "action"])
RECONCILE_SECONDS = Histogram("kvpilot_operator_reconcile_duration_seconds", "Time of one reconcile",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


def serve(port: int, address: str = "0.0.0.0") -> None:
    """GET :port/metrics in a daemon thread."""
    start_http_server(port, addr=address)
