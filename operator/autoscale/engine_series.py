"""Where each autoscaling metric lives in Prometheus, for the modes that read it from there
(`hpa` through prometheus-adapter, `keda` through its Prometheus scaler).

Engine pods are scraped as job `kvpilot-engine`, with the labels `namespace`, `name` (the
InferenceService) and `pod`. The names prometheus-adapter exposes are vLLM's with the colon made
an underscore (`vllm:num_requests_waiting` -> `vllm_num_requests_waiting`), so HPAs written for
vLLM read kvpilot unchanged; the chart's adapter rules (templates/prometheus-adapter-rules.yaml)
expose exactly these names, and a test checks that they do.

Gauges are averaged over the window, as the builtin policy averages its scrapes, and counters
and histograms are rates over it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scaling_spec import Metric

ENGINE_JOB = "kvpilot-engine"


@dataclass(frozen=True)
class EngineSeries:
    series: str  # as the engine exports it
    adapter_name: str  # as prometheus-adapter exposes it on custom.metrics.k8s.io
    per_pod: bool  # a per-pod value averaged over the pods; else one value for the service

    def service_query(self, selector: str, window_s: float) -> str:
        """PromQL for one value for the whole service: the sum over its pods for a per-pod
        metric (an HPA AverageValue target divides it by the replicas), else the value itself.
        `selector` is the inside of a label matcher, `window_s` the range."""
        span = f"[{max(1, round(window_s))}s]"
        if self.series.endswith("_total"):
            return f"sum(rate({self.series}{{{selector}}}{span}))"
        if self.series.endswith("_bucket"):
            # No request in the window makes the quantile NaN; an idle service has no latency
            # to scale on, so it reads as 0, as the builtin policy reads it.
            return (f"(histogram_quantile(0.99, sum by (le) (rate({self.series}{{{selector}}}{span}))) >= 0)"
                    f" or vector(0)")
        return f"sum(avg_over_time({self.series}{{{selector}}}{span}))"


SERIES: dict[Metric, EngineSeries] = {
    "kvCacheUsage": EngineSeries("vllm:kv_cache_usage_perc", "vllm_kv_cache_usage_perc", True),
    "waitingPerReplica": EngineSeries("vllm:num_requests_waiting", "vllm_num_requests_waiting", True),
    "preemptionRate": EngineSeries("vllm:num_preemptions_total", "vllm_num_preemptions_per_second", True),
    "ttftP99": EngineSeries("vllm:time_to_first_token_seconds_bucket", "vllm_time_to_first_token_seconds_p99",
                            False),
}


def service_selector(namespace: str, name: str) -> str:
    """The label matchers of one InferenceService's engine series."""
    return f'job="{ENGINE_JOB}",namespace="{namespace}",name="{name}"'
