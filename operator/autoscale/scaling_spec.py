"""What the autoscaler may do: the operator's form of `spec.autoscaling`.

Every field maps to one CRD field under `spec.autoscaling` (named beside it). `behavior` is
HPA v2's `behavior` field for field, integer seconds included, so `mode: hpa` and `mode: keda`
copy it into the objects they own unchanged, and `mode: builtin` applies it the way the HPA
controller does (`behavior.py`). Defaults are the HPA's own.

`metric` is one of:
* `kvCacheUsage` — mean fraction of KV blocks in use per ready pod (`target` <= 1; the
  serving-engine rule of thumb is to add replicas once it stays above 0.85);
* `waitingPerReplica` — mean requests waiting per ready pod;
* `preemptionRate` — mean preemptions per second per ready pod;
* `ttftP99` — the service's P99 time to first token in seconds, from the pods' histograms
  merged (a service-wide value, as an HPA `Object` or KEDA `Value` metric, not a per-pod mean).

`forecast` (builtin only) scales up for the arrival rate forecast one start-up plus one interval
ahead (`forecast.py`); hpa and keda cannot forecast, so a spec that sets it for them is refused.

Some settings are the cluster's once an HPA does the scaling, so a spec that sets them for a
mode that cannot honour them is refused rather than silently ignored: `window` and `interval`
(with `mode: hpa` the prometheus-adapter rules fix the range and the HPA controller its sync
period) are None when the CRD leaves them out, and take their mode's default.

The CRD fields, under `spec.autoscaling` (defaults in brackets; the CRD gives no default to
`window` and `interval`):
    enabled: boolean [false]
    mode: builtin | hpa | keda [builtin]
    minReplicas: integer >= 1 [1]; maxReplicas: integer >= minReplicas [4]
    metric: kvCacheUsage | waitingPerReplica | preemptionRate | ttftP99 [kvCacheUsage]
    target: number > 0, <= 1 for kvCacheUsage [0.85]
    tolerance: number in [0, 1) [0.1]
    window, interval: duration such as 60s or 1m, not with mode hpa
    behavior: scaleUp, scaleDown: {stabilizationWindowSeconds: 0..3600,
        selectPolicy: Max | Min | Disabled [Max],
        policies: [{type: Pods | Percent, value: integer >= 1, periodSeconds: 1..1800}] (1 or more)}
        [scaleUp: 0 s, Percent 100 and Pods 4 per 15 s; scaleDown: 300 s, Percent 100 per 15 s]
    prometheusAddress: http(s) URL, only with mode keda
    forecast: {enabled: boolean [true], horizon: duration [the measured start-up + interval],
        lookback: duration [90s]}, only with mode builtin
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Literal
from urllib.parse import urlsplit

Metric = Literal["kvCacheUsage", "waitingPerReplica", "preemptionRate", "ttftP99"]
METRICS: tuple[Metric, ...] = ("kvCacheUsage", "waitingPerReplica", "preemptionRate", "ttftP99")
Mode = Literal["builtin", "hpa", "keda"]
MODES: tuple[Mode, ...] = ("builtin", "hpa", "keda")
PolicyType = Literal["Pods", "Percent"]
SelectPolicy = Literal["Max", "Min", "Disabled"]

# The HPA controller's --horizontal-pod-autoscaler-tolerance default.
DEFAULT_TOLERANCE = 0.1
DEFAULT_WINDOW_S = 60.0
DEFAULT_INTERVAL_S = 15.0  # the HPA controller's sync period
DEFAULT_LOOKBACK_S = 90.0


@dataclass(frozen=True)
class ScalingPolicy:
    """At most `value` pods (or `value` percent of the replicas at the period's start) added or
    removed within any `period_s` seconds."""

    type: PolicyType  # type
    value: int  # value
    period_s: int  # periodSeconds

    def __post_init__(self) -> None:
        if self.type not in ("Pods", "Percent"):
            raise ValueError(f"type: must be Pods or Percent, not {self.type!r}")
        if self.value < 1:
            raise ValueError(f"value: must be >= 1, not {self.value}")
        if not 1 <= self.period_s <= 1800:  # the HPA API's own range
            raise ValueError(f"period_s: must lie in [1, 1800], not {self.period_s}")

    def to_hpa(self) -> dict[str, str | int]:
        return {"type": self.type, "value": self.value, "periodSeconds": self.period_s}


@dataclass(frozen=True)
class ScalingRules:
    """One direction of `behavior`: scaleUp or scaleDown."""

    stabilization_window_s: int  # stabilizationWindowSeconds
    policies: tuple[ScalingPolicy, ...]  # policies
    select_policy: SelectPolicy = "Max"  # selectPolicy: the policy allowing the largest change

    def __post_init__(self) -> None:
        if not 0 <= self.stabilization_window_s <= 3600:
            raise ValueError(f"stabilization_window_s: must lie in [0, 3600], not {self.stabilization_window_s}")
        if not self.policies:
            raise ValueError("policies: at least one is needed")
        if self.select_policy not in ("Max", "Min", "Disabled"):
            raise ValueError(f"select_policy: must be Max, Min or Disabled, not {self.select_policy!r}")

    @property
    def longest_period_s(self) -> int:
        return max(p.period_s for p in self.policies)

    def to_hpa(self, tolerance: float) -> dict[str, object]:
        """HPA v2's HPAScalingRules; `tolerance` is written only where it is not the cluster's
        default, since only HPAs from Kubernetes 1.33 (HPAConfigurableTolerance) read it."""
        rules: dict[str, object] = {"stabilizationWindowSeconds": self.stabilization_window_s,
                                    "selectPolicy": self.select_policy,
                                    "policies": [p.to_hpa() for p in self.policies]}
        if tolerance != DEFAULT_TOLERANCE:
            rules["tolerance"] = quantity(tolerance)
        return rules


SCALE_UP = ScalingRules(0, (ScalingPolicy("Percent", 100, 15), ScalingPolicy("Pods", 4, 15)))
SCALE_DOWN = ScalingRules(300, (ScalingPolicy("Percent", 100, 15),))


@dataclass(frozen=True)
class Behavior:
    scale_up: ScalingRules = SCALE_UP  # scaleUp
    scale_down: ScalingRules = SCALE_DOWN  # scaleDown

    def to_hpa(self, tolerance: float) -> dict[str, object]:
        return {"scaleUp": self.scale_up.to_hpa(tolerance), "scaleDown": self.scale_down.to_hpa(tolerance)}


@dataclass(frozen=True)
class Forecasting:
    """`spec.autoscaling.forecast`: how builtin looks ahead (`forecast.py`)."""

    horizon_s: float | None = None  # horizon: None is the measured start-up plus one interval
    lookback_s: float = DEFAULT_LOOKBACK_S  # lookback: the rate points the trend is fitted to

    def __post_init__(self) -> None:
        if self.horizon_s is not None and self.horizon_s < 0:
            raise ValueError(f"forecast.horizon: must be >= 0, not {self.horizon_s}")
        if self.lookback_s <= 0:
            raise ValueError(f"forecast.lookback: must be positive, not {self.lookback_s}")


@dataclass(frozen=True)
class ScalingSpec:
    """`spec.autoscaling` of an InferenceService, with the CRD field of each setting."""

    enabled: bool = False  # enabled
    mode: Mode = "builtin"  # mode
    min_replicas: int = 1  # minReplicas
    max_replicas: int = 4  # maxReplicas
    metric: Metric = "kvCacheUsage"  # metric
    target: float = 0.85  # target: per pod, or seconds for ttftP99
    tolerance: float = DEFAULT_TOLERANCE  # tolerance: |value/target - 1| within it changes nothing
    window_s: float | None = None  # window: builtin and keda only (default 60s)
    interval_s: float | None = None  # interval: builtin decides, keda polls, this often (default 15s)
    behavior: Behavior = field(default_factory=Behavior)  # behavior
    prometheus_address: str | None = None  # prometheusAddress: keda only; else the operator's default
    forecast: Forecasting | None = None  # forecast: builtin only; None scales on the present alone

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, not {self.mode!r}")
        if self.metric not in METRICS:
            raise ValueError(f"metric: must be one of {METRICS}, not {self.metric!r}")
        # No pod, no engine metric to scale back up from: zero needs an activator in front.
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas: must be >= 1, not {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas: must be >= min_replicas ({self.min_replicas}), not {self.max_replicas}")
        if self.target <= 0:
            raise ValueError(f"target: must be positive, not {self.target}")
        if self.metric == "kvCacheUsage" and self.target > 1:
            raise ValueError(f"target: kvCacheUsage is a fraction, must be <= 1, not {self.target}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance: must lie in [0, 1), not {self.tolerance}")
        for name in ("window_s", "interval_s"):
            value = getattr(self, name)
            if value is not None and self.mode == "hpa":
                raise ValueError(f"{name}: mode hpa takes it from the cluster (the adapter's rules, the HPA "
                                 f"controller's sync period); leave it out")
            if value is not None and value <= 0:
                raise ValueError(f"{name}: must be positive, not {value}")
        if self.prometheus_address is not None:
            if self.mode != "keda":
                raise ValueError(f"prometheus_address: only mode keda reads it, not mode {self.mode}")
            check_prometheus_address(self.prometheus_address)
        if self.forecast is not None and self.mode != "builtin":
            raise ValueError(f"forecast: only mode builtin forecasts, not mode {self.mode}")

    @property
    def window(self) -> float:
        """Seconds of data behind each decision."""
        return DEFAULT_WINDOW_S if self.window_s is None else self.window_s

    @property
    def interval(self) -> float:
        return DEFAULT_INTERVAL_S if self.interval_s is None else self.interval_s

    def horizon(self, startup_s: float | None) -> float | None:
        """How far ahead builtin forecasts, given the service's measured start-up (None: none
        measured yet); None when it does not forecast or cannot yet."""
        if self.forecast is None:
            return None
        if self.forecast.horizon_s is not None:
            return self.forecast.horizon_s
        return None if startup_s is None else startup_s + self.interval


def check_prometheus_address(address: str) -> str:
    parts = urlsplit(address)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"prometheus_address: must be an http(s) URL such as "
                         f"http://prometheus.monitoring.svc:9090, not {address!r}")
    return address


def quantity(value: float) -> str:
    """A Kubernetes quantity for a non-negative number: integers as they are, fractions in
    milli-units where that is exact (0.85 -> 850m), else as a decimal."""
    if value == int(value):
        return str(int(value))
    milli = value * 1000
    if abs(milli - round(milli)) < 1e-9:
        return f"{round(milli)}m"
    return format(Decimal(repr(value)), "f")
