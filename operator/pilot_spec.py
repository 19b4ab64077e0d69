"""`spec.autotune` and `spec.autoscaling` (the CRD's camelCase, pydantic) -> the autotuner's
`TuningSpec` and the autoscaler's `ScalingSpec` (frozen dataclasses, seconds for durations); the
rest of the spec -> the basis the autotuner's measured outcomes hold for (`measurement_basis`).

What the CRD cannot say in its schema (a canary window longer than its timeout, a knob range
whose min exceeds its max) is refused here, as a `SpecError` naming the field, so a spec that
cannot work becomes the Degraded InvalidSpec condition instead of a loop that never acts.
"""

from __future__ import annotations

import hashlib
import json

from kvpilot.runtime.tunables import BLOCK_SIZE, PREEMPTION_MODE

from .autoscale.scaling_spec import (
    DEFAULT_LOOKBACK_S,
    SCALE_DOWN,
    SCALE_UP,
    Behavior,
    Forecasting,
    ScalingPolicy,
    ScalingRules,
    ScalingSpec,
)
from .autotune.tuning_spec import (
    CanarySpec,
    EngineTarget,
    KnobRange,
    SloTargets,
    Thresholds,
    TuningSpec,
)
from .model_source import SpecError
from .spec import (
    AutoscalingSpec,
    AutotuneSpec,
    EngineTargetSpec,
    InferenceServiceSpec,
    RangeSpec,
    ScalingRulesSpec,
)

_UNITS = {"s": 1, "m": 60, "h": 3600}


def seconds(duration: str) -> float:
    """'30s' -> 30.0, '10m' -> 600.0 (the CRD's pattern: a count and one unit)."""
    count, unit = duration[:-1], duration[-1:]
    if not count.isdigit() or unit not in _UNITS:
        raise ValueError(f"{duration!r} is not a duration such as 30s, 10m or 1h")
    return float(int(count) * _UNITS[unit])


def _target(given: EngineTargetSpec, default: EngineTarget) -> EngineTarget:
    return EngineTarget(given.block_size or default.block_size, given.preemption_mode or default.preemption_mode)


def _range(given: RangeSpec | None) -> KnobRange | None:
    return None if given is None else KnobRange(given.min, given.max)


def tuning_spec(spec: AutotuneSpec) -> TuningSpec:
    """SpecError (naming `spec.autotune.*`) when the values cannot work together."""
    defaults = TuningSpec()
    t = spec.thresholds
    try:
        return TuningSpec(
            enabled=spec.enabled, interval_s=seconds(spec.interval), apply=spec.apply,
            allowed_block_sizes=tuple(spec.allowed_block_sizes),
            allowed_preemption_modes=tuple(spec.allowed_preemption_modes),
            pressure=_target(spec.pressure, defaults.pressure), calm=_target(spec.calm, defaults.calm),
            thresholds=Thresholds(
                queue_depth_high=t.queue_depth_high, queue_depth_low=t.queue_depth_low,
                preemptions_per_s_high=t.preemptions_per_second_high,
                preemptions_per_s_low=t.preemptions_per_second_low,
                kv_cache_usage_high=t.kv_cache_usage_high, kv_cache_usage_low=t.kv_cache_usage_low,
                swap_min_context_tokens=t.swap_min_context_tokens),
            slo=SloTargets(spec.slo.ttft_p99_seconds, spec.slo.itl_p99_seconds),
            max_num_seqs=_range(spec.max_num_seqs), max_num_batched_tokens=_range(spec.max_num_batched_tokens),
            cooldown_s=seconds(spec.cooldown), min_dwell_s=seconds(spec.min_dwell),
            canary=CanarySpec(window_s=seconds(spec.canary.window), timeout_s=seconds(spec.canary.timeout),
                              min_requests=spec.canary.min_requests, tolerance=spec.canary.tolerance),
        )
    except ValueError as exc:
        raise SpecError(f"spec.autotune: {exc}") from None


def _rules(given: ScalingRulesSpec, default: ScalingRules) -> ScalingRules:
    policies = default.policies if given.policies is None else tuple(
        ScalingPolicy(p.type, p.value, p.period_seconds) for p in given.policies)
    window = default.stabilization_window_s if given.stabilization_window_seconds is None \
        else given.stabilization_window_seconds
    return ScalingRules(window, policies, given.select_policy or default.select_policy)


def scaling_spec(spec: AutoscalingSpec) -> ScalingSpec:
    """SpecError (naming `spec.autoscaling.*`) when the values cannot work together."""
    try:
        return ScalingSpec(
            enabled=spec.enabled, mode=spec.mode, min_replicas=spec.min_replicas, max_replicas=spec.max_replicas,
            metric=spec.metric, target=spec.target, tolerance=spec.tolerance,
            window_s=None if spec.window is None else seconds(spec.window),
            interval_s=None if spec.interval is None else seconds(spec.interval),
            behavior=Behavior(_rules(spec.behavior.scale_up, SCALE_UP), _rules(spec.behavior.scale_down, SCALE_DOWN)),
            prometheus_address=spec.prometheus_address,
            forecast=_forecasting(spec),
        )
    except ValueError as exc:
        raise SpecError(f"spec.autoscaling: {exc}") from None


def _forecasting(spec: AutoscalingSpec) -> Forecasting | None:
    """On by default in mode builtin; a forecast set for another mode reaches ScalingSpec, which
    refuses it."""
    given = spec.forecast
    if given is None:
        return Forecasting() if spec.mode == "builtin" else None
    if not given.enabled:
        return None
    return Forecasting(None if given.horizon is None else seconds(given.horizon),
                       DEFAULT_LOOKBACK_S if given.lookback is None else seconds(given.lookback))


# engine flags that do not change what a configuration gets through per second at capacity: the
# knobs an outcome is measured for (an `EngineTarget`'s), and logging, metrics, the seed and the queue's bound
_NOT_BASIS = (BLOCK_SIZE.camel, PREEMPTION_MODE.camel, "disableLogStats", "metricInterval", "maxQueueLen", "seed")


def measurement_basis(spec: InferenceServiceSpec, image: str) -> tuple[tuple[str, str], ...]:
    """What the autotuner's measured outcomes hold for (`autotune.Outcomes.rebase`): the model,
    the image the pods run, their GPUs and where they are placed, and every engine flag set away
    from its default other than those in `_NOT_BASIS`. Defaults are left out, so a release that
    adds a flag does not change the basis of a spec that leaves it unset."""
    model, placement = spec.model, spec.placement
    engine = {k: v for k, v in spec.engine.model_dump(by_alias=True, exclude_defaults=True).items()
              if k not in _NOT_BASIS}
    where = [f"{k}={v}" for k, v in sorted(placement.node_selector.items())]
    if placement.affinity:
        digest = hashlib.sha256(json.dumps(placement.affinity, sort_keys=True).encode()).hexdigest()[:12]
        where.append(f"affinity {digest}")
    if placement.runtime_class_name:
        where.append(f"runtimeClass {placement.runtime_class_name}")
    basis = {
        "model": f"{model.source} ({model.load_format}, {model.dtype}, quantization {model.quantization or 'none'})",
        "image": image,
        "gpus": f"{spec.resources.gpus} a pod, tensor parallel {spec.tensor_parallel_size}",
        "placement": ", ".join(where) or "any node",
        "engine": ", ".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in sorted(engine.items())) or "defaults",
    }
    return tuple(sorted(basis.items()))
