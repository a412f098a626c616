"""ProxyMetrics: histogram observations folded in at scrape time."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from fastroute.proxy.metrics import LATENCY_BUCKETS_S, TBOT_BUCKETS_S, ProxyMetrics

# On bounds, between them, below the first, above the last, zero.
_VALUES = [0.0, 0.005, 0.0051, 0.3, 1.0, 2.5, 119.0, 120.0, 500.0, 0.0001]


def _samples(text: bytes, family: str) -> dict[str, str]:
    """``name{labels}`` -> value of the bucket/count/sum lines of one family."""
    out = {}
    for line in text.decode().splitlines():
        if line.startswith(family + "_") and not line.startswith(family + "_created"):
            key, value = line.rsplit(" ", 1)
            out[key] = value
    return out


def _direct(name: str, buckets: tuple[float, ...], values: list[float]) -> bytes:
    registry = CollectorRegistry()
    hist = Histogram(name, "x", ["class", "engine"], buckets=buckets, registry=registry)
    for v in values:
        hist.labels("chat", "e0").observe(v)
    return generate_latest(registry)


def test_pending_histograms_expose_what_direct_observation_would() -> None:
    metrics = ProxyMetrics(lambda: None)
    for v in _VALUES:
        metrics.e2e_of("chat", "e0").observe(v)
        metrics.ttft_of("chat", "e0").observe(v)
        metrics.tbot_of("chat", "e0").observe(v / 100)
    text = metrics.render()
    for family, buckets, values in (
        ("fastroute_proxy_e2e_seconds", LATENCY_BUCKETS_S, _VALUES),
        ("fastroute_proxy_ttft_seconds", LATENCY_BUCKETS_S, _VALUES),
        ("fastroute_proxy_tbot_seconds", TBOT_BUCKETS_S, [v / 100 for v in _VALUES]),
    ):
        want = _samples(_direct(family, buckets, values), family)
        assert want and _samples(text, family) == want, family


def test_pending_histogram_flushes_add_and_nan_only_reaches_the_sum() -> None:
    metrics = ProxyMetrics(lambda: None)
    metrics.e2e_of("chat", "e0").observe(0.2)
    metrics.render()
    metrics.e2e_of("chat", "e0").observe(0.2)
    first = _samples(metrics.render(), "fastroute_proxy_e2e_seconds")
    assert first['fastroute_proxy_e2e_seconds_count{class="chat",engine="e0"}'] == "2.0"
    assert first['fastroute_proxy_e2e_seconds_bucket{class="chat",engine="e0",le="0.25"}'] == "2.0"
    metrics.e2e_of("chat", "e0").observe(math.nan)
    after = _samples(metrics.render(), "fastroute_proxy_e2e_seconds")
    assert after['fastroute_proxy_e2e_seconds_count{class="chat",engine="e0"}'] == "2.0"
    assert after['fastroute_proxy_e2e_seconds_sum{class="chat",engine="e0"}'] == "NaN"


def test_metric_children_cached() -> None:
    """Metric children cached; counted responses reach the exposition at scrape time."""
    metrics = ProxyMetrics(lambda: None)
    for _ in range(3):
        metrics.count_request("chat", "e0", 200)
    metrics.in_flight_count = 2
    text = metrics.render()
    assert b'fastroute_proxy_requests_total{class="chat",engine="e0",status="200"} 3.0' in text
    assert b"fastroute_proxy_in_flight 2.0" in text
    metrics.count_request("chat", "e0", 200)
    assert b'status="200"} 4.0' in metrics.render()  # flushes add, never reset
    assert metrics.e2e_of("chat", "e0").child is metrics.e2e.labels("chat", "e0")
    assert metrics.ttft_of("c", "e") is metrics.ttft_of("c", "e")
