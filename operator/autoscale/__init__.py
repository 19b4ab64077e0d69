"""Autoscaling an InferenceService on its engines' saturation signals: the parts that need no
Kubernetes client.

* `scaling_spec` — `ScalingSpec`: the operator's form of `spec.autoscaling` (HPA v2 `behavior`).
* `policy` — `decide_replicas` (`mode: builtin`): pod windows + replicas + spec + `ScalerState`
  -> `ScaleDecision`, by the HPA's own algorithm (`calculator`, `behavior`).
* `hpa` — `build_hpa` (`mode: hpa`); `keda` — `build_scaled_object` (`mode: keda`) and
  `missing_api`, which tells from discovery whether the cluster can serve the mode.
* `deletion_cost` — `deletion_costs`: the pod-deletion-cost annotations that make a scale-down
  remove the least loaded pod.
* `coordination` — `Coordination`: the autotuner and the autoscaler take turns.
* `history` — `DecisionRecord` and `appended`: both kinds of decision in one bounded list.
"""

from .behavior import ScalerState
from .calculator import PodState
from .coordination import Coordination, Turn
from .deletion_cost import DELETION_COST_ANNOTATION, CostBand, cost_patch, deletion_costs
from .history import HISTORY_LIMIT, DecisionRecord, appended, scale_record, tune_record
from .hpa import build_hpa
from .keda import MissingApi, build_scaled_object, missing_api, scaling_condition
from .policy import ScaleDecision, decide_replicas
from .scaling_spec import METRICS, Behavior, ScalingPolicy, ScalingRules, ScalingSpec

__all__ = [
    "DELETION_COST_ANNOTATION", "HISTORY_LIMIT", "METRICS", "Behavior", "Coordination", "CostBand",
    "DecisionRecord", "MissingApi", "PodState", "ScaleDecision", "ScalerState", "ScalingPolicy", "ScalingRules",
    "ScalingSpec", "Turn", "appended", "build_hpa", "build_scaled_object", "cost_patch", "decide_replicas",
    "deletion_costs", "missing_api", "scale_record", "scaling_condition", "tune_record",
]
