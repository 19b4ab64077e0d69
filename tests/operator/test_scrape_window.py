"""A pod's `/metrics` page parsed into samples, and the window's summaries over them: rates that
survive restarts, histogram increases (quantiles of the span, not since start), baselines."""

from __future__ import annotations

import math

import pytest
from autotune_fixtures import PodMetrics

from kvpilot.operator.autotune import (
    Histogram,
    Knobs,
    LiveConfig,
    MetricsError,
    MetricWindow,
    parse_metrics,
)


def window_of(*pages: tuple[float, str], span_s: float = 600) -> MetricWindow:
    window = MetricWindow("pod-0", span_s)
    for time, text in pages:
        assert window.add(parse_metrics(text, time))
    return window


def test_a_page_parses_into_settings_levels_counters_and_histograms() -> None:
    pod = PodMetrics(block_size=32, mode="swap", num_gpu_blocks=512, max_num_seqs=64, max_num_batched_tokens=4096)
    pod.set(waiting=7, running=3, swapped=1, kv=0.25)
    pod.serve(2, prompt_tokens=40, output_tokens=5)
    sample = parse_metrics(pod.text(), 10.0)
    assert sample.settings.config == LiveConfig(32, "swap", 64, 4096, "fcfs") and sample.settings.num_gpu_blocks == 512
    assert sample.settings.knobs == Knobs(32, "swap", 64, 4096)
    assert sample.gauges == {"kv_cache_usage": 0.25, "num_waiting_seqs": 7, "num_running_seqs": 3, "num_swapped_seqs": 1,
                             "num_requests_waiting": 7, "num_requests_running": 3}
    (tokens,) = sample.counters["prompt_tokens"].values()
    assert tokens.value == 80 and tokens.created is not None
    assert len(sample.counters["swap_bytes"]) == 2  # one series per direction
    (ttft,) = sample.histograms["ttft"].values()
    assert ttft.count == 2 and ttft.bounds[-1] == math.inf
    (prompts,), (generated,) = sample.histograms["prompt_lengths"].values(), sample.histograms["generation_lengths"].values()
    assert (prompts.mean, generated.mean) == (40, 5)  # each finished request's token counts
    assert sample.tokens_in_kv_cache == 0.25 * 512 * 32


@pytest.mark.parametrize(("text", "named"), [
    ("<html><body>Not Found</body></html>\n", "not Prometheus text"),
    ("up 1\nnode_load1 0.5\n", "kvpilot_kv_cache_usage_ratio is missing"),
    ("kvpilot_kv_cache_usage_ratio{model_name=\"m\"} abc\n", "not Prometheus text"),
])
def test_a_page_that_is_not_a_kvpilot_page_is_refused_by_name(text: str, named: str) -> None:
    with pytest.raises(MetricsError, match=named):
        parse_metrics(text, 0.0)


def test_a_page_without_one_config_in_force_is_refused() -> None:
    pod = PodMetrics()
    text = pod.text().replace('num_gpu_blocks="1000"', 'num_gpu_blocks="lots"')
    with pytest.raises(MetricsError, match="vllm:cache_config_info"):
        parse_metrics(text, 0.0)
    for broken in (pod.text().replace('max_num_seqs="256"', 'max_num_seqs="0"'),  # outside the contract's bounds
                   pod.text().replace('max_num_batched_tokens="2048",', ""),
                   "\n".join(line for line in pod.text().splitlines() if "kvpilot_live_config_info" not in line)):
        with pytest.raises(MetricsError, match="kvpilot_live_config_info"):
            parse_metrics(broken, 0.0)


def test_rates_are_counter_increases_over_the_span() -> None:
    pod = PodMetrics()
    first = pod.text()
    pod.preemptions.inc(30)
    pod.swap_out.inc(4096)
    pod.swap_in.inc(1024)
    pod.serve(6, prompt_tokens=100, output_tokens=10)
    s = window_of((0.0, first), (60.0, pod.text())).summarize()
    assert s is not None and s.duration_s == 60.0
    assert s.preemptions_per_s == pytest.approx(0.5)
    assert s.swap_bytes_per_s == pytest.approx(5120 / 60)
    assert s.prompt_tokens_per_s == pytest.approx(10.0)
    assert s.generation_tokens_per_s == pytest.approx(1.0)
    assert s.num_requests == 6 and s.num_restarts == 0


def test_a_restart_that_lowers_a_counter_counts_the_new_value_from_zero() -> None:
    before = PodMetrics()
    before.preemptions.inc(100)
    p0 = before.text()
    before.preemptions.inc(50)
    p1 = before.text()
    after = PodMetrics()  # the pod restarted
    after.preemptions.inc(20)
    p2 = after.text()
    after.preemptions.inc(40)
    s = window_of((0.0, p0), (30.0, p1), (60.0, p2), (90.0, after.text())).summarize()
    assert s is not None and s.num_restarts == 1
    assert s.preemptions_per_s == pytest.approx((50 + 20 + 40) / 90)


def test_a_restart_that_overtakes_the_old_value_is_told_by_its_created_time() -> None:
    before = PodMetrics()
    before.prompt_tokens.inc(100)
    after = PodMetrics()
    after.prompt_tokens.inc(250)  # more than before, yet a new process: all 250 are new
    s = window_of((0.0, before.text()), (10.0, after.text())).summarize()
    assert s is not None and s.num_restarts == 1
    assert s.prompt_tokens_per_s == pytest.approx(25.0)


def test_without_created_series_a_lower_counter_still_reads_as_a_restart() -> None:
    def bare(pod: PodMetrics) -> str:
        return "".join(line + "\n" for line in pod.text().splitlines() if "_created" not in line)

    before, after = PodMetrics(), PodMetrics()
    before.generation_tokens.inc(500)
    after.generation_tokens.inc(30)
    s = window_of((0.0, bare(before)), (10.0, bare(after))).summarize()
    assert s is not None and s.num_restarts == 1 and s.generation_tokens_per_s == pytest.approx(3.0)


def test_quantiles_are_the_span_s_own_not_since_the_pod_started() -> None:
    pod = PodMetrics()
    pod.serve(1000, ttft=2.0)  # slow history before the window
    first = pod.text()
    pod.serve(100, ttft=0.05)
    s = window_of((0.0, first), (60.0, pod.text())).summarize()
    assert s is not None and s.ttft.count == 100
    p99 = s.ttft.quantile(0.99)
    assert p99 is not None and 0.04 < p99 <= 0.06
    cumulative = next(iter(parse_metrics(pod.text(), 60.0).histograms["ttft"].values()))
    assert cumulative.quantile(0.99) > 1.0  # what a since-start quantile would have said


def test_histogram_increases_survive_a_restart() -> None:
    before = PodMetrics()
    before.serve(50)
    after = PodMetrics()
    after.serve(30)
    s = window_of((0.0, before.text()), (30.0, after.text())).summarize()
    assert s is not None and s.e2e.count == 30 and s.itl.count == 30 * 9


def test_a_summary_starts_from_the_newest_sample_at_or_before_since() -> None:
    pod = PodMetrics()
    pages = []
    for i, waiting in enumerate((100, 100, 10, 20)):
        pod.set(waiting=waiting)
        pod.preemptions.inc(10)
        pages.append((10.0 * i, pod.text()))
    s = window_of(*pages).summarize(since=15.0)
    assert s is not None and (s.start, s.end, s.num_samples) == (10.0, 30.0, 2)
    assert s.num_waiting_seqs == 15.0  # the baseline's level stands for time before the span
    assert s.preemptions_per_s == pytest.approx(20 / 20)
    assert window_of(*pages).summarize(since=15.0, until=20.0).end == 20.0
    assert window_of(*pages).summarize(since=30.0) is None  # nothing after the baseline


def test_the_window_keeps_its_span_plus_one_baseline_and_ignores_stale_samples() -> None:
    pod = PodMetrics()
    window = MetricWindow("pod-0", span_s=30)
    for i in range(11):
        window.add(parse_metrics(pod.text(), 10.0 * i))
    assert len(window) == 4  # 70 (baseline for 30 s before 100), 80, 90, 100
    assert not window.add(parse_metrics(pod.text(), 95.0))
    s = window.summarize()
    assert s is not None and (s.start, s.end) == (70.0, 100.0)


def test_mean_context_is_kv_tokens_per_running_sequence() -> None:
    pod = PodMetrics(block_size=16, num_gpu_blocks=1000)
    first = pod.text()
    pod.set(running=10, kv=0.5)
    second = pod.text()
    pod.set(running=0, kv=0.0)  # idle samples do not pull the mean down
    s = window_of((0.0, first), (10.0, second), (20.0, pod.text())).summarize()
    assert s is not None and s.mean_context_tokens == pytest.approx(800.0)
    idle = window_of((0.0, first), (10.0, first)).summarize()
    assert idle is not None and idle.mean_context_tokens is None


def test_a_settings_change_within_the_span_is_flagged_but_not_one_before_it() -> None:
    pod = PodMetrics()
    old = pod.text()
    pod.configure(LiveConfig(8, "swap", 256, 2048), 2000)
    new = pod.text()
    s = window_of((0.0, old), (10.0, new), (20.0, new)).summarize()
    assert s is not None and not s.settings_changed and s.settings.block_size == 8
    mixed = window_of((0.0, old), (10.0, old), (20.0, new)).summarize()
    assert mixed is not None and mixed.settings_changed
    pod.configure(LiveConfig(8, "swap", 512, 2048), 2000)  # a batch limit alone is a change too
    limits = window_of((0.0, new), (10.0, new), (20.0, pod.text())).summarize()
    assert limits is not None and limits.settings_changed and limits.settings.knobs.max_num_seqs == 512


def test_histogram_quantile_and_count_interpolate_within_buckets() -> None:
    h = Histogram((1.0, 2.0, math.inf), (10.0, 20.0, 20.0))
    assert h.quantile(0.5) == pytest.approx(1.0)
    assert h.quantile(0.75) == pytest.approx(1.5)
    assert h.count_at_most(1.5) == pytest.approx(15.0)
    assert h.count_at_most(0.5) == pytest.approx(5.0)
    tail = Histogram((1.0, 2.0, math.inf), (10.0, 20.0, 30.0))
    assert tail.quantile(0.99) == 2.0  # in +Inf: the highest finite bound, as Prometheus says
    assert tail.count_at_most(100.0) == 20.0  # past the last bound nothing is known
    assert Histogram((math.inf,), (0.0,)).quantile(0.99) is None


def test_histograms_of_different_layouts_merge_on_their_shared_bounds() -> None:
    a = Histogram((1.0, 2.0, math.inf), (1.0, 3.0, 4.0), 5.0)
    b = Histogram((2.0, 4.0, math.inf), (2.0, 2.0, 6.0), 7.0)
    assert a + b == Histogram((2.0, math.inf), (5.0, 10.0), 12.0)
