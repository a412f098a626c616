"""Parsing engine /metrics text (both vLLM name generations) and histogram window math."""

from __future__ import annotations

import math

import pytest

from fastroute.emulator.faults import FaultController
from fastroute.emulator.metrics import EngineMetrics
from fastroute.emulator.model import EngineConfig, EngineModel
from fastroute.hardware import get_profile
from fastroute.signals.vllm import (
    CumulativeHistogram,
    MetricsParseError,
    bucket_quantile,
    histogram_window,
    merge_signals,
    parse_vllm_metrics,
)


def _metrics(compat: str, model_name: str = "demo-8b") -> EngineMetrics:
    model = EngineModel(get_profile("h100"), EngineConfig(), seed=0)
    return EngineMetrics(model_name, model, FaultController("e0"), compat=compat)


@pytest.mark.parametrize("compat", ["current", "legacy", "both"])
def test_parses_emulator_metrics_of_every_name_generation(compat: str) -> None:
    """The emulator's real /metrics text yields every field, whichever names it uses."""
    m = _metrics(compat)
    for v in (0.05, 0.3, 0.3):
        m.ttft.observe(v)
    m.itl.observe(0.02)
    m.e2e.observe(1.2)
    out = parse_vllm_metrics(m.render().decode(), scraped_at_s=10.0, scrape_duration_s=0.01)
    assert list(out) == ["demo-8b"]
    s = out["demo-8b"]
    assert s.num_requests_running == 0.0 and s.num_requests_waiting == 0.0
    assert s.kv_cache_usage is not None
    assert s.prefix_cache_queries_total == 0.0 and s.prefix_cache_hits_total == 0.0
    assert s.preemptions_total == 0.0
    assert s.ttft_s is not None and s.ttft_s.count == 3 and s.ttft_s.sum == pytest.approx(0.65)
    assert s.itl_s is not None and s.itl_s.count == 1
    assert s.e2e_s is not None and s.e2e_s.count == 1
    assert s.ttft_s.buckets[-1] == (math.inf, 3.0)
    assert (s.scraped_at_s, s.scrape_duration_s) == (10.0, 0.01)


def test_both_generations_count_once_and_current_wins() -> None:
    """An engine exposing old and new names is not double counted; the new name wins."""
    text = (
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.9\n'
        'vllm:time_per_output_token_seconds_count{model_name="m"} 7\n'
        'vllm:inter_token_latency_seconds_count{model_name="m"} 3\n'
    )
    s = parse_vllm_metrics(text)["m"]
    assert s.kv_cache_usage == 0.5
    assert s.itl_s is not None and s.itl_s.count == 3


def test_missing_metrics_are_none_and_models_are_separate() -> None:
    """Absent metrics are None; series are grouped by model_name and DP ranks summed."""
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="a",engine="0"} 2\n'
        'vllm:num_requests_running{model_name="a",engine="1"} 3\n'
        'vllm:kv_cache_usage_perc{model_name="a",engine="0"} 0.2\n'
        'vllm:kv_cache_usage_perc{model_name="a",engine="1"} 0.4\n'
        'vllm:num_requests_waiting{model_name="b"} 1\n'
        "process_cpu_seconds_total 12\n"
    )
    out = parse_vllm_metrics(text)
    assert sorted(out) == ["a", "b"]
    assert out["a"].num_requests_running == 5.0
    assert out["a"].kv_cache_usage == pytest.approx(0.3)
    assert out["a"].num_requests_waiting is None and out["a"].ttft_s is None
    assert out["b"].num_requests_waiting == 1.0 and out["b"].num_requests_running is None
    merged = merge_signals(list(out.values()))
    assert merged.num_requests_running == 5.0 and merged.num_requests_waiting == 1.0
    assert parse_vllm_metrics("# nothing here\n") == {}


@pytest.mark.parametrize(
    "text",
    [
        'vllm:num_requests_running{model_name="m"} not-a-number\n',
        'vllm:num_requests_running{model_name="m" 1\n',
        "}{ garbage\n",
    ],
)
def test_malformed_text_raises_a_specific_error(text: str) -> None:
    """Malformed exposition text raises MetricsParseError (a ValueError), not anything else."""
    with pytest.raises(MetricsParseError):
        parse_vllm_metrics(text)


def test_histogram_window_mean_and_quantiles() -> None:
    """Two successive cumulative scrapes give the window's count, mean and quantiles."""
    prev = CumulativeHistogram(1.0, 10, ((0.1, 5.0), (0.5, 10.0), (math.inf, 10.0)))
    cur = CumulativeHistogram(5.0, 30, ((0.1, 5.0), (0.5, 20.0), (math.inf, 30.0)))
    w = histogram_window(prev, cur)
    assert (w.count, w.sum, w.reset) == (20, 4.0, False)
    assert w.mean == pytest.approx(0.2)
    assert w.buckets == ((0.1, 0.0), (0.5, 10.0), (math.inf, 20.0))
    assert w.quantile(0.25) == pytest.approx(0.3)  # halfway through (0.1, 0.5]
    assert w.quantile(0.9) == 0.5  # in +Inf: the largest finite bound
    first = histogram_window(None, prev)
    assert first.count == 10 and first.quantile(0.5) == pytest.approx(0.1)


def test_histogram_window_on_counter_reset_and_empty() -> None:
    """A restarted engine (counts went down) yields the new scrape as the window; empty → None."""
    prev = CumulativeHistogram(9.0, 100, ((1.0, 100.0), (math.inf, 100.0)))
    cur = CumulativeHistogram(0.5, 2, ((1.0, 2.0), (math.inf, 2.0)))
    w = histogram_window(prev, cur)
    assert w.reset and w.count == 2 and w.mean == 0.25
    empty = histogram_window(cur, cur)
    assert empty.count == 0 and empty.mean is None and empty.quantile(0.5) is None
    with pytest.raises(ValueError):
        bucket_quantile(1.5, cur.buckets)
