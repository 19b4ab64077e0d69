"""Closed-loop tuning of live serving pods: the parts that need no Kubernetes.

* `scrape` — `ServiceScraper`: every interval, `GET /metrics` from each Ready pod at once into
  a per-pod `MetricWindow` of `Sample`s (`sample`, `window`); `WindowSummary` is a window's
  rates, means and histogram increases over a span.
* `policy` — `decide`: summaries + config in force + `TuningSpec` -> `Decision`.
* `outcomes` — `Outcomes`: each configuration's throughput while the service ran at capacity,
  which the policy uses to keep what paid on this hardware and leave what did not, and the pause
  each switch caused, which it weighs against a switch's expected gain; kept in status.
* `canary` — `judge`: the canary pod's window against a baseline -> promote | rollback | wait.
* `admin` — `AdminClient`: the engine's `GET/POST /admin/config`.

Imports neither torch nor kvpilot.runtime: pods are reached over HTTP only.
"""

from kvpilot.runtime.tunables import LiveConfig

from .admin import AdminClient, AdminError, AppliedConfig
from .canary import CanaryJudgement, judge
from .endpoint import PodEndpoint
from .engine_limits import EngineLimits
from .outcomes import Estimate, Outcomes
from .policy import Decision, decide
from .sample import EngineSettings, Histogram, MetricsError, Sample, parse_metrics
from .scrape import ScrapeFailure, ScrapeReport, ServiceScraper
from .signals import Signals, aggregate
from .tuning_spec import (
    TUNED,
    CanarySpec,
    EngineTarget,
    KnobRange,
    Knobs,
    SloTargets,
    Thresholds,
    TuningSpec,
)
from .window import MetricWindow, WindowSummary

__all__ = [
    "AdminClient", "AdminError", "AppliedConfig", "CanaryJudgement", "CanarySpec", "Decision",
    "TUNED", "EngineLimits", "EngineSettings", "EngineTarget", "Estimate", "Histogram", "KnobRange", "Knobs",
    "LiveConfig",
    "MetricWindow", "MetricsError", "Outcomes", "PodEndpoint", "Sample", "ScrapeFailure", "ScrapeReport",
    "ServiceScraper", "Signals", "SloTargets", "Thresholds", "TuningSpec", "WindowSummary",
    "aggregate", "decide", "judge", "parse_metrics",
]
