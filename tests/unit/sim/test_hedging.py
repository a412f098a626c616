"""Hedged first tokens in the simulator: the proxy's rule, its gain and its cost."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.sim import Simulator, summarize
from fastroute.sim.hedging import HedgeDelays
from fastroute.sim.scenario import DataPlaneConfig, ScenarioError


def _slow_engine(small, hedge: bool, **dataplane):
    """One of four engines 3x slow from the start (no ejection: it never fails)."""
    return small(
        engines=[{"name": "eu-h100", "count": 4, "region": "eu", "capacity_rps": 10.0}],
        regions=[{"name": "eu"}],
        workload={"rate_sessions_per_s": 4.0, "sources": [{"name": "eu"}]},
        faults=[{"kind": "slowdown", "engines": ["eu-h100-0"], "start_s": 0.0, "factor": 3.0}],
        dataplane={"hedge": hedge, "outlier_ejection": False, **dataplane},
    )


def test_hedging_cuts_the_slow_engines_ttft_tail_at_a_bounded_cost(small):
    # Round robin keeps sending the slow engine its share: the default policy sees its
    # queued prefill and avoids it, which is not what this test measures.
    off = Simulator(_slow_engine(small, False), policy="round-robin", seed=3).run().records
    on = Simulator(_slow_engine(small, True), policy="round-robin", seed=3).run().records
    s_off, s_on = summarize(off)["overall"], summarize(on)["overall"]
    assert s_off["hedges"] == 0 and s_on["hedges"] > 0
    assert s_on["ttft_s"]["p99"] < 0.8 * s_off["ttft_s"]["p99"]
    assert 0 < s_on["hedge_extra_prefill"] < 0.2
    assert all(r.outcome == "ok" for r in on)
    assert max(r.attempts for r in on) <= 2
    won = [r for r in on if r.hedge_won]
    assert won and all(r.hedged and r.engine != "eu-h100-0" for r in won)
    assert all(r.hedge_prefill_tokens == 0 for r in on if not r.hedged)


def test_the_budget_caps_hedges_attempts_per_request(small):
    """Ratio 0 and a floor of 0.2/s over 10 s: at most floor × duration hedges in all."""
    scenario = _slow_engine(small, True, retry_ratio=0.0, min_retries_per_s=0.2, retry_ttl_s=10.0)
    records = Simulator(scenario, seed=3).run().records
    hedged = sum(r.hedged for r in records)
    span_s = scenario.duration_s + scenario.drain_s
    assert 0 < hedged <= 0.2 * (span_s + 10.0)
    attempts = sum(r.attempts for r in records)
    assert attempts <= len(records) + 0.2 * (span_s + 10.0)


def test_no_hedge_while_the_class_is_shed(small, monkeypatch):
    from fastroute.sim import core

    scenario = _slow_engine(small, True)
    sim = Simulator(scenario, seed=3)
    for dp in sim.dataplanes:  # every table the data plane pulls sheds the class a bit

        def set_table(*table, dp=dp, set_table=dp.set_table):
            set_table(*table)
            dp.shed_fraction = dp.shed_fraction + 1e-9

        dp.set_table = set_table
        dp.shed_fraction = dp.shed_fraction + 1e-9
    monkeypatch.setattr(core, "should_shed", lambda key, fraction: False)  # admit them all
    assert not any(r.hedged for r in sim.run().records)


def test_the_delay_follows_the_quantile_with_a_floor():
    cfg = DataPlaneConfig(hedge=True, hedge_min_samples=10, hedge_floor_s=0.05)
    delays = HedgeDelays(cfg, default_s=2.0)
    assert delays.delay_s(1, 0) == 2.0
    for x in np.linspace(0.01, 1.0, 100):
        delays.observe(1, 0, float(x))
    assert delays.delay_s(1, 0) == pytest.approx(0.96)
    assert delays.delay_s(2, 0) == 2.0  # each data plane and class has its own


def test_bad_hedge_settings_are_refused(small):
    with pytest.raises(ScenarioError, match="hedge_quantile"):
        small(dataplane={"hedge_quantile": 1.0})
