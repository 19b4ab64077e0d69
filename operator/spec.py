"""The InferenceService spec as typed, frozen models: the operator's one edge with the CRD.

The CRD (crds/) is the source of truth for defaults and validation; the defaults here repeat it
(a test checks they agree) because an object may reach the operator without the API server's
defaulting, e.g. one stored before a field was added. The engine defaults are the runtime's own
(`kvpilot serve`'s flags): tests/operator/test_engine_defaults.py compares all three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, create_model
from pydantic.alias_generators import to_camel

from kvpilot.runtime.tunables import (
    BLOCK_SIZE,
    PREEMPTION_MODE,
    PREEMPTION_MODES,
    TUNABLES,
    TunableArgs,
)

# the live tunables' values and bounds are the runtime's contract (kvpilot.runtime.tunables)
BlockSize = Annotated[int, AfterValidator(BLOCK_SIZE.check)]
PreemptionMode = Annotated[str, AfterValidator(PREEMPTION_MODE.check)]
Quantity = int | str
# The CRD's duration pattern: a count and one unit (30s, 10m, 1h).
Duration = Annotated[str, StringConstraints(pattern=r"^[0-9]+(s|m|h)$")]


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True,
                              extra="ignore")


class ModelSpec(_Model):
    source: str
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    quantization: Literal["auto", "fp8", "awq", "gptq"] | None = None  # None: not passed (the runtime's auto)
    served_model_name: str | None = None


class ResourcesSpec(_Model):
    gpus: int = Field(default=1, ge=0)
    cpu: Quantity = "4"
    memory: Quantity = "16Gi"
    shm_size: Quantity = "2Gi"


def _tunable_fields() -> dict[str, Any]:
    """Each live tunable as a field of spec.engine: the contract's name, CRD spelling, rule and
    default (an unset one, None, is the runtime's to resolve)."""
    fields: dict[str, Any] = {}
    for t in TUNABLES:
        checked: Any = Annotated[t.kind, AfterValidator(t.check)]
        fields[t.name] = (checked if t.default is not None else checked | None,
                          Field(default=t.default, alias=t.camel))
    return fields


if TYPE_CHECKING:  # the same fields as the contract types them (a test compares the two)
    class _TunablesSpec(_Model, TunableArgs):
        pass
else:
    _TunablesSpec = create_model("_TunablesSpec", __base__=_Model, __module__=__name__, **_tunable_fields())


class EngineSpec(_TunablesSpec):
    """spec.engine: the live tunables' fields (from the contract), then the other engine arguments."""

    swap_space: float = Field(default=4, ge=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    max_model_len: int | None = None
    priority_aging: float = Field(default=10, gt=0, le=86400)
    fair_prompt_weight: float = Field(default=1, gt=0, le=1000)
    fair_output_weight: float = Field(default=2, gt=0, le=1000)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    enforce_eager: bool = False
    max_queue_len: int | None = None
    disable_log_stats: bool = False
    metric_interval: float = Field(default=10, ge=0.1, le=3600)
    device: Literal["auto", "cuda", "cpu"] = "auto"
    seed: int = Field(default=0, ge=0)


class AutotuneThresholds(_Model):
    queue_depth_high: float = Field(default=100, ge=0)
    queue_depth_low: float = Field(default=50, ge=0)
    preemptions_per_second_high: float = Field(default=1, ge=0)
    preemptions_per_second_low: float = Field(default=0.1, ge=0)
    kv_cache_usage_high: float = Field(default=0.9, ge=0, le=1)
    kv_cache_usage_low: float = Field(default=0.3, ge=0, le=1)
    swap_min_context_tokens: int = Field(default=0, ge=0)


class EngineTargetSpec(_Model):
    block_size: BlockSize | None = None
    preemption_mode: PreemptionMode | None = None


class SloSpec(_Model):
    ttft_p99_seconds: float | None = Field(default=None, gt=0)
    itl_p99_seconds: float | None = Field(default=None, gt=0)


class RangeSpec(_Model):
    min: int = Field(ge=1)
    max: int = Field(ge=1)


class CanaryCrdSpec(_Model):
    window: Duration = "5m"
    timeout: Duration = "15m"
    min_requests: int = Field(default=100, ge=1)
    tolerance: float = Field(default=0.05, ge=0, lt=1)


class AutotuneSpec(_Model):
    enabled: bool = False
    interval: Duration = "60s"
    cooldown: Duration = "10m"
    min_dwell: Duration = "60s"
    allowed_block_sizes: tuple[BlockSize, ...] = (8, 16, 32)
    allowed_preemption_modes: tuple[PreemptionMode, ...] = PREEMPTION_MODES
    pressure: EngineTargetSpec = EngineTargetSpec()
    calm: EngineTargetSpec = EngineTargetSpec()
    thresholds: AutotuneThresholds = AutotuneThresholds()
    slo: SloSpec = SloSpec()
    max_num_seqs: RangeSpec | None = None
    max_num_batched_tokens: RangeSpec | None = None
    canary: CanaryCrdSpec = CanaryCrdSpec()
    apply: Literal["live", "rollout"] = "live"


class PolicySpec(_Model):
    type: Literal["Pods", "Percent"]
    value: int = Field(ge=1)
    period_seconds: int = Field(ge=1, le=1800)


class ScalingRulesSpec(_Model):
    stabilization_window_seconds: int | None = Field(default=None, ge=0, le=3600)
    select_policy: Literal["Max", "Min", "Disabled"] | None = None
    policies: tuple[PolicySpec, ...] | None = None


class BehaviorSpec(_Model):
    scale_up: ScalingRulesSpec = ScalingRulesSpec()
    scale_down: ScalingRulesSpec = ScalingRulesSpec()


class ForecastSpec(_Model):
    enabled: bool = True
    horizon: Duration | None = None
    lookback: Duration | None = None


class AutoscalingSpec(_Model):
    enabled: bool = False
    mode: Literal["builtin", "hpa", "keda"] = "builtin"
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=4, ge=1)
    metric: Literal["kvCacheUsage", "waitingPerReplica", "preemptionRate", "ttftP99"] = "kvCacheUsage"
    target: float = Field(default=0.85, gt=0)
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    window: Duration | None = None
    interval: Duration | None = None
    behavior: BehaviorSpec = BehaviorSpec()
    prometheus_address: str | None = None
    forecast: ForecastSpec | None = None  # unset: on in mode builtin


class SecretKeyRef(_Model):
    name: str
    key: str = "api-key"


class DrainSpec(_Model):
    pre_stop_seconds: int = 5
    grace_period_seconds: int = 120


class DisruptionBudgetSpec(_Model):
    enabled: bool = True
    max_unavailable: int = 1


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class PlacementSpec(_Model):
    node_selector: dict[str, str] = {}
    tolerations: tuple[Toleration, ...] = ()
    affinity: dict[str, object] | None = None
    priority_class_name: str | None = None
    runtime_class_name: str | None = None


class ImagePullSecret(_Model):
    name: str


class InferenceServiceSpec(_Model):
    model: ModelSpec
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: tuple[ImagePullSecret, ...] = ()
    replicas: int = Field(default=1, ge=0)
    tensor_parallel_size: int = Field(default=1, ge=1)
    resources: ResourcesSpec = ResourcesSpec()
    engine: EngineSpec = EngineSpec()
    autotune: AutotuneSpec = AutotuneSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    api_key_secret_ref: SecretKeyRef | None = None
    startup_timeout_seconds: int = Field(default=1800, ge=30)
    drain: DrainSpec = DrainSpec()
    pod_disruption_budget: DisruptionBudgetSpec = DisruptionBudgetSpec()
    placement: PlacementSpec = PlacementSpec()
    pod_annotations: dict[str, str] = {}
    pod_labels: dict[str, str] = {}
