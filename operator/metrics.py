"""The operator's own Prometheus metrics (its pods' metrics are the runtime's).

Series about one InferenceService carry its `namespace` and `name` as labels; the chart's
ServiceMonitor sets honorLabels so Prometheus keeps them instead of the operator pod's own
`namespace`/`pod` target labels. The chart's alerts and dashboard read these names: change one
and tests/charts/test_monitoring_metrics.py fails.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("kvpilot_operator_reconciles", "InferenceService reconciles by result",
                     ["result"])  # success | retry | conflict | failed
API_ERRORS = Counter("kvpilot_operator_api_errors", "Kubernetes API errors by HTTP status (0: unreachable)",
                     ["status"])
CHILD_CHANGES = Counter("kvpilot_operator_child_changes", "Children written, by kind and action",
                        ["kind", "action"])
RECONCILE_SECONDS = Histogram("kvpilot_operator_reconcile_duration_seconds", "Time of one reconcile",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

_SERVICE = ["namespace", "name"]
SCRAPES = Counter("kvpilot_operator_scrapes", "Scrapes of engine pods' /metrics by result",
                  [*_SERVICE, "result"])  # ok | error | timeout
TUNING_DECISIONS = Counter("kvpilot_operator_tuning_decisions", "Autotuner decisions by outcome",
                           [*_SERVICE, "outcome"])  # applied | canary | promoted | rolled_back | skipped
TUNING_ROLLBACKS = Counter("kvpilot_operator_tuning_rollbacks",
                           "Tuning changes the autotuner undid because the service got worse", _SERVICE)
SCALING_DECISIONS = Counter("kvpilot_operator_scaling_decisions", "Autoscaler decisions by direction",
                            [*_SERVICE, "direction"])  # up | down
DESIRED_REPLICAS = Gauge("kvpilot_operator_desired_replicas",
                         "Replicas the operator wants for the InferenceService", _SERVICE)
LIVE_BLOCK_SIZE = Gauge("kvpilot_operator_live_block_size",
                        "KV block size an engine pod reported at its last scrape", [*_SERVICE, "pod"])


def serve(port: int, address: str = "0.0.0.0") -> None:
    """GET :port/metrics in a daemon thread."""
    start_http_server(port, addr=address)
