"""Fault state semantics and the Prometheus exposition (vLLM names, types, buckets)."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastroute.emulator.faults import FaultController, FaultState, FaultUpdate
from fastroute.emulator.metrics import (
    E2E_BUCKETS_S,
    ITL_BUCKETS_S,
    TTFT_BUCKETS_S,
    EngineMetrics,
)
from fastroute.emulator.model import EngineModel, Request, replay
from fastroute.hardware import PROFILES


def test_fault_updates_merge_and_validate():
    """A partial update changes only its fields; an invalid one leaves the state unchanged."""
    c = FaultController("e", FaultState(slowdown=2.0))
    c.apply(msgspec.json.decode(b'{"error_rate": 0.5}', type=FaultUpdate).changes())
    assert (c.state.slowdown, c.state.error_rate) == (2.0, 0.5)
    for bad in ({"error_status": 404}, {"slowdown": 0}, {"error_rate": 1.5}, {"refuse_for_s": -1}):
        with pytest.raises(ValueError):
            c.apply(bad)
    assert (c.state.slowdown, c.state.error_rate, c.state.error_status) == (2.0, 0.5, 500)
    assert c.clear() == FaultState()


def test_unknown_fault_fields_are_rejected():
    """POST /admin/fault bodies may only name known fields."""
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"explode": true}', type=FaultUpdate)


def test_error_draws_are_seeded_and_near_the_rate():
    """The same seed gives the same failures; about error_rate of requests fail."""
    draws = []
    for _ in range(2):
        c = FaultController("e", FaultState(error_rate=0.3, error_status=503), seed=7)
        draws.append([c.draw_error() for _ in range(1000)])
    assert draws[0] == draws[1]
    failed = [d for d in draws[0] if d is not None]
    assert set(failed) == {503} and 230 < len(failed) < 370


def _families(metrics: EngineMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_exposition_has_vllm_names_types_and_buckets():
    """Every vLLM metric fastroute reads is present with its type, labels and vLLM's buckets."""
    model = EngineModel(PROFILES["h100"])
    met = EngineMetrics("llama", model, FaultController("e"))
    fams = _families(met)
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert fams[name].type == kind, name
        assert all(s.labels.get("model_name") == "llama" for s in fams[name].samples), name
    assert "vllm:gpu_cache_usage_perc" not in fams

    def bounds(name: str) -> list[float]:
        return [
            float(s.labels["le"])
            for s in fams[name].samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
        ]

    assert bounds("vllm:time_to_first_token_seconds") == list(TTFT_BUCKETS_S)
    assert bounds("vllm:inter_token_latency_seconds") == list(ITL_BUCKETS_S)
    assert bounds("vllm:e2e_request_latency_seconds") == list(E2E_BUCKETS_S)
    assert len(TTFT_BUCKETS_S) == 22 and len(ITL_BUCKETS_S) == 19 and len(E2E_BUCKETS_S) == 21


def test_legacy_names_are_selectable():
    """compat='legacy' exposes gpu_cache_usage_perc and time_per_output_token instead."""
    met = EngineMetrics("m", EngineModel(PROFILES["a40"]), FaultController("e"), compat="legacy")
    fams = _families(met)
    assert "vllm:gpu_cache_usage_perc" in fams and "vllm:kv_cache_usage_perc" not in fams
    assert "vllm:time_per_output_token_seconds" in fams
    assert "vllm:inter_token_latency_seconds" not in fams
    both = _families(
        EngineMetrics("m", EngineModel(PROFILES["a40"]), FaultController("e"), compat="both")
    )
    assert {"vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"} <= set(both)
    with pytest.raises(ValueError):
        EngineMetrics("m", EngineModel(PROFILES["a40"]), FaultController("e"), compat="v0")


def test_counters_are_read_from_the_model():
    """After a replay the exposed counters equal the model's own totals."""
    model = EngineModel(PROFILES["h100"])
    replay(model, [(0.0, Request(f"r{i}", 100 + i, (), output_tokens=10)) for i in range(5)])
    fams = _families(EngineMetrics("m", model, FaultController("e")))

    def value(name: str, **labels: str) -> float:
        return next(
            s.value
            for s in fams[name].samples
            if s.name == name + "_total" and labels.items() <= s.labels.items()
        )

    assert value("vllm:generation_tokens") == 50
    assert value("vllm:prompt_tokens") == sum(100 + i for i in range(5))
    assert value("vllm:request_success", finished_reason="length") == 5


def test_fault_gauges_show_active_kinds():
    """fastroute_emulator_fault_active is 1 exactly for the active fault kinds."""
    faults = FaultController("e", FaultState(hang=True, metrics_delay_s=0.5))
    fams = _families(EngineMetrics("m", EngineModel(PROFILES["a40"]), faults))
    active = {s.labels["kind"]: s.value for s in fams["fastroute_emulator_fault_active"].samples}
    assert active == {
        "slowdown": 0.0,
        "error": 0.0,
        "hang": 1.0,
        "crash": 0.0,
        "stream_error": 0.0,
        "refuse": 0.0,
        "metrics_delay": 1.0,
        "metrics_lie": 0.0,
        "drain": 0.0,
    }
