"""Each engine kind's ``/metrics`` dialect, read from real exposition text.

``exposition/vllm_0_32.txt`` was scraped from a real vLLM 0.32.0 (CPU build, the real-engine
tier's tiny model) after two completions sharing a 128-token prefix; the SGLang and llama.cpp
pages follow those engines' sources (``sglang/srt/metrics/collector.py``, llama.cpp's
``tools/server`` README), current and older generations.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fastroute.signals.dialects import ENGINE_KINDS, dialect_for
from fastroute.signals.exposition import plain_samples
from fastroute.signals.vllm import merge_signals, parse_engine_metrics, parse_vllm_metrics

PAGES = Path(__file__).parent / "exposition"


def page(name: str) -> str:
    return (PAGES / name).read_text()


def test_kinds_are_the_config_kinds() -> None:
    from typing import get_args

    from fastroute.config import EngineKind

    assert ENGINE_KINDS == get_args(EngineKind)
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        dialect_for("tgi")
    with pytest.raises(ValueError, match="unknown engine kind"):
        parse_engine_metrics("", "tgi")


def test_real_vllm_0_32_page() -> None:
    assert plain_samples(page("vllm_0_32.txt"), "vllm:")  # the fast reader takes it
    out = parse_engine_metrics(page("vllm_0_32.txt"), "vllm", scraped_at_s=5.0)
    assert list(out) == ["tiny"]
    s = out["tiny"]
    assert (s.num_requests_running, s.num_requests_waiting, s.kv_cache_usage) == (0.0, 0.0, 0.0)
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total) == (737.0, 128.0)
    assert s.prefix_cache_hit_ratio == pytest.approx(128 / 737)
    assert s.prefix_cache_hit_rate is None and s.preemptions_total == 0.0
    assert s.generation_tokens_total == 51.0
    assert s.ttft_s is not None and s.ttft_s.count == 14.0
    assert s.ttft_s.sum == pytest.approx(1.2838218212127686)
    assert s.ttft_s.buckets[-1] == (float("inf"), 14.0)
    assert s.itl_s is not None and s.itl_s.count == 37.0  # inter_token_latency, current name
    assert s.e2e_s is not None and s.e2e_s.count == 14.0
    assert s.scraped_at_s == 5.0
    assert parse_vllm_metrics(page("vllm_0_32.txt"), scraped_at_s=5.0) == out
    # the vLLM page read as another kind has none of that kind's metrics: no signal
    assert parse_engine_metrics(page("vllm_0_32.txt"), "sglang") == {}


def test_sglang_page_with_rank_labels() -> None:
    out = parse_engine_metrics(page("sglang.txt"), "sglang")
    s = out["meta-llama/Llama-3.1-8B-Instruct"]
    assert (s.num_requests_running, s.num_requests_waiting) == (3.0, 2.0)
    assert s.kv_cache_usage == 0.28
    assert s.prefix_cache_hit_rate == pytest.approx(0.007507552643049313)
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total) == (8.128902e6, 61024.0)
    assert s.preemptions_total == 4.0 and s.generation_tokens_total == 7.557572e6
    assert s.ttft_s is not None and (s.ttft_s.count, s.ttft_s.sum) == (100.0, 21.5)
    assert s.ttft_s.buckets == ((0.1, 10.0), (0.2, 40.0), (0.4, 90.0), (float("inf"), 100.0))
    assert s.itl_s is not None and s.itl_s.count == 1000.0
    assert s.e2e_s is not None and s.e2e_s.sum == 250.0
    assert list(out) == ["meta-llama/Llama-3.1-8B-Instruct"]


def test_sglang_before_0_4_labels_name_and_has_time_per_output_token() -> None:
    s = parse_engine_metrics(page("sglang_legacy.txt"), "sglang")["google/gemma-2-9b-it"]
    assert (s.num_requests_running, s.num_requests_waiting, s.kv_cache_usage) == (7.0, 1.0, 0.5)
    assert s.itl_s is not None and (s.itl_s.count, s.itl_s.sum) == (40.0, 0.6)
    assert s.ttft_s is None and s.prefix_cache_hit_rate is None


def test_sglang_ratios_are_averaged_over_ranks_and_counts_summed() -> None:
    text = "".join(
        f'sglang:num_running_reqs{{model_name="m",tp_rank="{r}"}} {n}\n'
        f'sglang:token_usage{{model_name="m",tp_rank="{r}"}} {u}\n'
        f'sglang:cache_hit_rate{{model_name="m",tp_rank="{r}"}} {h}\n'
        for r, n, u, h in ((0, 2, 0.2, 0.5), (1, 3, 0.4, 0.7))
    )
    s = parse_engine_metrics(text, "sglang")["m"]
    assert s.num_requests_running == 5.0
    assert s.kv_cache_usage == pytest.approx(0.3)
    assert s.prefix_cache_hit_rate == pytest.approx(0.6)


def test_llamacpp_page_has_no_model_label_and_no_histograms() -> None:
    out = parse_engine_metrics(page("llamacpp.txt"), "llamacpp")
    assert list(out) == [""]
    s = out[""]
    assert (s.num_requests_running, s.num_requests_waiting) == (2.0, 1.0)
    assert s.kv_cache_usage is None  # current llama-server builds do not export it
    assert s.ttft_s is None and s.itl_s is None and s.e2e_s is None
    assert s.prefix_cache_queries_total is None and s.generation_tokens_total == 7801.0


def test_older_llamacpp_exports_kv_cache_usage() -> None:
    s = parse_engine_metrics(page("llamacpp_legacy.txt"), "llamacpp")[""]
    assert (s.kv_cache_usage, s.num_requests_running, s.num_requests_waiting) == (0.5, 1.0, 0.0)


def test_openai_kind_reads_nothing() -> None:
    assert parse_engine_metrics(page("vllm_0_32.txt"), "openai") == {}
    assert not dialect_for("openai").has_metrics
    assert all(dialect_for(k).has_metrics for k in ("vllm", "sglang", "llamacpp"))


def test_no_known_metric_is_no_signal_and_merging_nothing_is_refused() -> None:
    assert parse_engine_metrics("# HELP up Up.\n# TYPE up gauge\nup 1\n", "vllm") == {}
    with pytest.raises(ValueError, match="at least one"):
        merge_signals([])


def test_merge_averages_the_hit_rate() -> None:
    a = parse_engine_metrics('sglang:cache_hit_rate{model_name="a"} 0.2\n', "sglang")["a"]
    b = parse_engine_metrics('sglang:cache_hit_rate{model_name="b"} 0.4\n', "sglang")["b"]
    assert merge_signals([a, b]).prefix_cache_hit_rate == pytest.approx(0.3)
    assert merge_signals([a]).kv_cache_usage is None


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llamacpp"])
def test_enable_hints_name_the_flag(kind: str) -> None:
    hint = dialect_for(kind).enable_hint
    assert {"vllm": "url", "sglang": "--enable-metrics", "llamacpp": "--metrics"}[kind] in hint
