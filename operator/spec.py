"""The InferenceService spec as typed, frozen models: the operator's one edge with the CRD.

The CRD (crds/) is the source of truth for defaults and validation; the defaults here repeat it
(a test checks they agree) because an object may reach the operator without the API server's
defaulting, e.g. one stored before a field was added. The engine defaults are the runtime's own
(`kvpilot serve`'s flags): tests/operator/test_engine_defaults.py compares all three.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

BlockSize = Literal[8, 16, 32, 64]
PreemptionMode = Literal["recompute", "swap"]
Quantity = int | str


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True,
                              extra="ignore")


class ModelSpec(_Model):
    source: str
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    quantization: str | None = None
    served_model_name: str | None = None


class ResourcesSpec(_Model):
    gpus: int = Field(default=1, ge=0)
    cpu: Quantity = "4"
    memory: Quantity = "16Gi"
    shm_size: Quantity = "2Gi"


class EngineSpec(_Model):
    block_size: BlockSize = 16
    swap_space: float = Field(default=4, ge=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    preemption_mode: PreemptionMode = "recompute"
    scheduler_policy: Literal["fcfs", "fair", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    enforce_eager: bool = False
    max_queue_len: int | None = None
    disable_log_stats: bool = False
    metric_interval: float = Field(default=10, ge=0.1, le=3600)
    device: Literal["auto", "cuda", "cpu"] = "auto"
    seed: int = Field(default=0, ge=0)


class AutotuneThresholds(_Model):
    kv_cache_usage_high: float = 0.9
    kv_cache_usage_low: float = 0.3
    preemptions_per_second_high: float = 1
    queue_depth_high: int = 8


class AutotuneSpec(_Model):
    enabled: bool = False
    interval: str = "60s"
    cooldown: str = "10m"
    allowed_block_sizes: tuple[BlockSize, ...] = (8, 16, 32)
    allowed_preemption_modes: tuple[PreemptionMode, ...] = ("recompute", "swap")
    thresholds: AutotuneThresholds = AutotuneThresholds()
    apply: Literal["live", "rollout"] = "live"


class AutoscalingSpec(_Model):
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    metric: Literal["kvCacheUsage", "numRequestsWaiting", "numRequestsRunning"] = "numRequestsWaiting"
    target: float = 4
    mode: Literal["builtin", "hpa"] = "builtin"
    scale_down_delay: str = "5m"


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
