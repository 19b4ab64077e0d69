"""What the fleet simulator (`fleet.py`) is given besides the curve and the trace: the run's
configuration, when a policy's pods are scraped, and the policy (a mode's spec, or a yardstick
that reads the trace's rate)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.bench.autoscale_modes import Cluster
from kvpilot.operator.autoscale import ScalingSpec


@dataclass(frozen=True)
class SimConfig:
    tick_s: float = 1.0
    startup_s: float = 120.0  # created to Ready: scheduling, container start, model load, probes
    pending_s: float = 5.0  # the first part of it, Pending: scheduled, sandbox and container started
    slo_ttft_s: float = 1.0  # a request meets the SLO with TTFT within this...
    slo_e2e_s: float | None = None  # ...and, when set, E2E within this
    request_timeout_s: float = 60.0  # clients give up on a request queued this long
    cluster: Cluster = Cluster()  # how modes hpa and keda see the pods
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tick_s", "slo_ttft_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, not {getattr(self, name)}")
        if self.startup_s < 0:
            raise ValueError(f"startup_s: must be >= 0, not {self.startup_s}")
        if not 0 <= self.pending_s <= self.startup_s:
            raise ValueError(f"pending_s: must lie in [0, startup_s = {self.startup_s:g}], not {self.pending_s}")
        if self.slo_e2e_s is not None and self.slo_e2e_s <= 0:
            raise ValueError(f"slo_e2e_s: must be positive, not {self.slo_e2e_s}")


@dataclass(frozen=True)
class Pipeline:
    """When a policy's pods are scraped: every `scrape_interval_s` from `phase_s`."""

    scrape_interval_s: float
    phase_s: float = 0.0

    def __post_init__(self) -> None:
        if self.scrape_interval_s <= 0 or self.phase_s < 0:
            raise ValueError(f"scrape_interval_s must be positive and phase_s >= 0, not {self.scrape_interval_s} "
                             f"and {self.phase_s}")


@dataclass(frozen=True)
class Foresight:
    """A yardstick, not a policy a cluster can run: the fleet reads the arrival rate from the
    trace, the highest over the next `seconds` (0: the present rate, exact and without lag, which
    is the most any signal of the pods could tell a reactive policy), and asks for
    ceil(rate / `rate_per_replica`) replicas, through the spec's behavior and bounds as a policy's
    estimate goes. With `seconds` at the start-up delay plus the decision interval it is
    clairvoyant: its replicas are Ready before the load that needs them arrives."""

    seconds: float
    rate_per_replica: float

    def __post_init__(self) -> None:
        if self.seconds < 0:
            raise ValueError(f"seconds: must be >= 0, not {self.seconds}")
        if self.rate_per_replica <= 0:
            raise ValueError(f"rate_per_replica: must be positive, not {self.rate_per_replica}")


@dataclass(frozen=True)
class Policy:
    name: str
    spec: ScalingSpec | None  # None: a fixed fleet
    pipeline: Pipeline
    initial_replicas: int
    foresight: Foresight | None = None  # set: a reference fleet scaled on the trace's rate, not on metrics
