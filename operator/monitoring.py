"""Engine monitoring: the PodMonitor that makes Prometheus scrape an InferenceService's pods.

A prometheus-operator PodMonitor (`monitoring.coreos.com/v1`) per InferenceService, owned by it
like every other child, selects the pods with the Deployment's own selector and scrapes the
serving port's `/metrics`. Two relabelings give every engine series the labels the chart's
alerts and dashboard select on: `job="kvpilot-engine"` and `name=<the InferenceService>`, the
same `{namespace, name}` pair that the operator's own series carry. Prometheus adds `namespace`
and `pod` itself.

Enabled by the chart (`engineMonitoring.enabled`), which passes the flags below to
`kvpilot operator`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .manifests import Owner, labels, owner_reference, selector_labels, with_spec_hash
from .objects import Manifest

ENGINE_JOB = "kvpilot-engine"
METRICS_PATH = "/metrics"
PORT_NAME = "http"  # the serving container's port name (manifests.build_container)

# prometheus-operator's Duration: units from largest to smallest, each at most once (30s, 1m30s).
_DURATION = re.compile(r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")
_DURATION_UNITS = (365 * 86400.0, 7 * 86400.0, 86400.0, 3600.0, 60.0, 1.0, 0.001)
_LABEL_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^(?:{_LABEL_NAME})?$")


def duration_seconds(text: str) -> float:
    """'1m30s' -> 90.0; ValueError for anything prometheus-operator would refuse."""
    match = _DURATION.match(text)
    if not text or match is None:
        raise ValueError(f"{text!r} is not a duration such as 30s, 1m or 1m30s")
    return sum(float(n) * unit for n, unit in zip(match.groups(), _DURATION_UNITS, strict=True) if n)


@dataclass(frozen=True)
class EngineMonitoring:
    """How the operator asks Prometheus to scrape the engines it creates."""

    enabled: bool = False
    interval: str = "30s"
    scrape_timeout: str = "10s"
    # Labels on each PodMonitor so that a Prometheus selects it, e.g. {"release": "kube-prometheus-stack"}.
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("interval", "scrape_timeout"):
            try:
                seconds = duration_seconds(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            if seconds <= 0:
                raise ValueError(f"{name}: must be longer than 0, got {getattr(self, name)!r}")
        # Prometheus refuses to load a scrape config whose timeout exceeds its interval.
        if duration_seconds(self.scrape_timeout) > duration_seconds(self.interval):
            raise ValueError(f"scrape_timeout: {self.scrape_timeout} is longer than interval {self.interval}")
        for key, value in self.labels.items():
            if not _LABEL_KEY.match(key):
                raise ValueError(f"labels: {key!r} is not a valid Kubernetes label key")
            if not _LABEL_VALUE.match(value):
                raise ValueError(f"labels: {value!r} (for {key}) is not a valid Kubernetes label value")
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))


def build_pod_monitor(owner: Owner, monitoring: EngineMonitoring) -> Manifest:
    pod_monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {
            "name": owner.name,
            "namespace": owner.namespace,
            # ours last: a Prometheus-selection label cannot take over the operator's own
            "labels": {**monitoring.labels, **labels(owner)},
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": {
            "selector": {"matchLabels": selector_labels(owner)},
            "podMetricsEndpoints": [{
                "port": PORT_NAME,
                "path": METRICS_PATH,
                "interval": monitoring.interval,
                "scrapeTimeout": monitoring.scrape_timeout,
                "relabelings": [
                    {"action": "replace", "targetLabel": "job", "replacement": ENGINE_JOB},
                    {"action": "replace", "targetLabel": "name", "replacement": owner.name},
                ],
            }],
        },
    }
    return with_spec_hash(pod_monitor)


_FLAGS = {"interval": "--engine-monitoring-interval", "scrape_timeout": "--engine-monitoring-timeout",
          "labels": "--engine-monitoring-label"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineMonitoring()
    parser.add_argument("--engine-monitoring", action="store_true",
                        help="create a prometheus-operator PodMonitor per InferenceService so Prometheus "
                             "scrapes every engine pod (needs the monitoring.coreos.com CRDs)")
    parser.add_argument("--engine-monitoring-interval", default=defaults.interval, metavar="DURATION",
                        help="scrape interval of the engine pods (default %(default)s)")
    parser.add_argument("--engine-monitoring-timeout", default=defaults.scrape_timeout, metavar="DURATION",
                        help="scrape timeout, at most the interval (default %(default)s)")
    parser.add_argument("--engine-monitoring-label", action="append", default=[], metavar="KEY=VALUE",
                        help="label on every PodMonitor, e.g. release=kube-prometheus-stack (repeatable)")


def from_args(args: argparse.Namespace) -> EngineMonitoring:
    """ValueError naming the flag when one is bad."""
    pairs: dict[str, str] = {}
    for item in args.engine_monitoring_label:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--engine-monitoring-label: expected KEY=VALUE, got {item!r}")
        pairs[key] = value
    try:
        return EngineMonitoring(enabled=args.engine_monitoring, interval=args.engine_monitoring_interval,
                                scrape_timeout=args.engine_monitoring_timeout, labels=pairs)
    except ValueError as exc:  # "field: problem" -> "--flag: problem"
        field_name, _, problem = str(exc).partition(": ")
        raise ValueError(f"{_FLAGS.get(field_name, field_name)}: {problem}") from None
