"""Percentiles, per-engine shares, SLO attainment and goodput of request records."""

from __future__ import annotations

import pytest

from fastroute.loadgen import RequestRecord, percentile, summarize
from fastroute.loadgen.summary import NO_CODE


def rec(engine: str | None, *, ttft: float = 0.1, tbot: float = 0.02, error: str | None = None,
        prompt: int = 100, cached: int = 50) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        session_id="s", tenant="t", source="east", model="m", turn=0, sent_at_s=0.0,
        status=200 if error is None else 503, error=error, engine=engine,
        ttft_s=ttft, tbot_s=tbot, e2e_s=ttft + 1.0, output_tokens=10,
        prompt_tokens=prompt, cached_tokens=cached,
    )  # fmt: skip


def test_percentile_interpolates_linearly() -> None:
    """docs/metrics.md: numpy.percentile's linear interpolation."""
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == pytest.approx(50.5)
    assert percentile(values, 0.99) == pytest.approx(99.01)
    assert percentile(values, 1.0) == 100.0
    assert percentile([4.0, 1.0], 0.5) == pytest.approx(2.5)
    assert percentile([3.0], 0.0) == 3.0
    assert percentile([], 0.5) is None
    with pytest.raises(ValueError):
        percentile(values, 1.5)


def test_summary_counts_shares_slo_and_cache() -> None:
    records = [
        rec("a", ttft=0.1),
        rec("a", ttft=3.0),  # misses the 2 s TTFT SLO
        rec("b", tbot=0.5, prompt=100, cached=0),  # misses the TBOT SLO
        rec("b", error="http_503"),
        rec(None, error="connect"),
    ]
    s = summarize(records, wall_s=2.0, ttft_slo_s=2.0, tbot_slo_s=0.1)
    assert (s.requests, s.ok) == (5, 3)
    assert s.errors == {"connect": 1, "http_503": 1}
    assert s.slo_met == 1 and s.slo_attainment == pytest.approx(0.2)
    assert s.goodput_rps == pytest.approx(0.5) and s.throughput_rps == pytest.approx(1.5)
    assert s.cache_hit_rate == pytest.approx(100 / 300)
    engines = {e.engine: e for e in s.engines}
    assert engines["a"].share == pytest.approx(0.5) and engines["b"].requests == 2
    assert engines["a"].ttft.p99_s == pytest.approx(0.1 + 0.99 * 2.9) and engines[
        "a"
    ].cache_hit_rate == pytest.approx(0.5)
    assert engines["b"].ttft.n == 1  # the failed request has no latency sample


def test_429s_are_split_by_their_error_code() -> None:
    records = [rec("a"), rec(None, error="http_503")]
    for code in ("load_shed", "load_shed", "overloaded", None):
        r = rec(None, error="http_429")
        r.error_code = code
        records.append(r)
    s = summarize(records, wall_s=1.0)
    assert s.errors == {"http_429": 4, "http_503": 1}
    assert s.rejects_429 == {NO_CODE: 1, "load_shed": 2, "overloaded": 1}
