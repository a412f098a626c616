"""summarize(), affinity loss and weight churn on hand-made records."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.sim.metrics import Slo, affinity_loss, summarize, weight_amplitude, weight_churn
from fastroute.sim.records import RequestRecord


def rec(i: int, **kw) -> RequestRecord:
    base = dict(
        request_id=f"r{i}",
        session_id=f"s{i}",
        arrival_s=float(i),
        first_token_s=float(i) + 0.5,
        finish_s=float(i) + 2.5,
        prompt_tokens=100,
        output_tokens=21,
        cached_tokens=50,
        engine="e0",
        cls="eu/m",
        source="eu",
    )
    base.update(kw)
    return RequestRecord(**base)


def test_latencies_of_one_record():
    """TTFT = first - arrival, e2e = finish - arrival, TBOT = (finish - first)/(n - 1)."""
    r = rec(0)
    assert (r.ttft_s, r.e2e_s, r.tbot_s) == (0.5, 2.5, 0.1)
    assert rec(0, output_tokens=1).tbot_s is None
    shed = rec(0, outcome="shed", first_token_s=None, attempts=0)
    assert (shed.ttft_s, shed.e2e_s, shed.tbot_s) == (None, None, None)


def test_summary_rates_percentiles_slo_and_goodput():
    """Counts, rates, percentiles and SLO attainment follow docs/metrics.md."""
    records = [rec(i, first_token_s=i + 0.1 * (i + 1)) for i in range(10)]
    records += [rec(10, outcome="shed", first_token_s=None, attempts=0, engine="")]
    records += [rec(11, outcome="failed", first_token_s=None, attempts=3)]
    s = summarize(records, slo=Slo(ttft_s=0.55, tbot_s=1.0), duration_s=20.0)
    o = s["overall"]
    assert (o["requests"], o["ok"], o["shed"], o["failed"]) == (12, 10, 1, 1)
    assert o["shed_rate"] == pytest.approx(1 / 12) and o["failure_rate"] == pytest.approx(1 / 12)
    assert o["attempts"] == 13 and o["retry_rate"] == pytest.approx((13 - 11) / 11)
    ttfts = [0.1 * (i + 1) for i in range(10)]
    assert o["ttft_s"]["p50"] == pytest.approx(np.percentile(ttfts, 50))
    assert o["ttft_s"]["p99"] == pytest.approx(np.percentile(ttfts, 99))
    assert o["slo_attainment"] == pytest.approx(5 / 12)  # TTFT 0.1 .. 0.5 meet 0.55
    assert o["goodput_rps"] == pytest.approx(5 / 20)
    assert o["prefix_hit_rate"] == pytest.approx(0.5)
    assert set(s["by_cls"]) == {"eu/m"}


def test_affinity_loss_counts_consecutive_turns_on_other_engines():
    """Pairs of consecutive turns of a session; a change of engine is a loss."""
    records = [
        rec(0, session_id="a", turn=0, engine="e0"),
        rec(1, session_id="a", turn=1, engine="e0"),
        rec(2, session_id="a", turn=2, engine="e1"),
        rec(3, session_id="b", turn=0, engine="e1"),
        rec(4, session_id="b", turn=1, engine="e1"),
        rec(5, session_id="c", turn=0, engine=""),  # never reached an engine
    ]
    assert affinity_loss(records) == (pytest.approx(1 / 3), 3)


def test_weight_churn_and_amplitude():
    """Churn is the demand-weighted total variation; amplitude the largest weight range."""
    w0 = np.array([[0.5, 0.5], [1.0, 0.0]])
    w1 = np.array([[0.7, 0.3], [1.0, 0.0]])
    assert weight_churn(w0, w1, np.array([3.0, 1.0])) == pytest.approx(0.75 * 0.2)
    assert weight_churn(w0, w1, np.zeros(2)) == 0.0
    assert weight_amplitude(np.stack([w0, w1, w0])) == pytest.approx(0.2)
