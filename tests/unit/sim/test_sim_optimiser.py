"""controller.sim_optimiser: the controller's LP and P-controller driving the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.sim import Simulator, make_optimiser


def test_lp_in_the_loop_publishes_valid_tables(small):
    """The LP publishes rows summing to 1 over eligible engines every period, and keeps
    most of a region's traffic in its region (network latency is in its cost)."""
    scenario = small(control={"optimiser": "lp", "period_s": 5.0})
    sim = Simulator(scenario, seed=1)
    result = sim.run()
    assert len(result.control) >= 8
    for c in result.control:
        assert np.allclose(c.weights.sum(axis=1), 1.0)
        assert np.all(c.weights[~sim.eligible] == 0)
    late = result.control[len(result.control) // 2]
    regions = np.array([e.region for e in sim.engines])
    for g, src in enumerate(sim.class_sources):
        assert late.weights[g, regions == src].sum() > 0.9
    assert all(r.outcome == "ok" for r in result.records)


def test_p_controller_in_the_loop_moves_weights(small):
    """The proportional baseline changes weights from period to period (it reacts to latency)."""
    scenario = small(control={"optimiser": "p-controller", "params": {"gain": 0.5}})
    result = Simulator(scenario, seed=1).run()
    assert sum(c.churn for c in result.control) > 0


def test_derating_marks_a_slow_engine(small):
    """With derating on, the controller's health tracker derates an engine 3x slower than its
    three peers (and only it)."""
    scenario = small(
        regions=[{"name": "eu"}],
        engines=[{"name": "e", "count": 4, "region": "eu", "capacity_rps": 10.0}],
        workload={"sources": [{"name": "eu"}], "rate_sessions_per_s": 6.0},
        faults=[{"kind": "slowdown", "engines": ["e-0"], "factor": 3.0}],
        duration_s=120.0,
        control={
            "optimiser": "lp",
            "period_s": 10.0,
            "params": {
                "derate": True,
                "derating": {"enter_windows": 2, "min_change_interval_s": 5.0},
            },
        },
    )
    result = Simulator(scenario, seed=1).run()
    health = [c.info.get("health") for c in result.control if c.info.get("health")]
    assert health and min(h[0] for h in health) < 1.0
    assert all(min(h[1:]) == 1.0 for h in health)


def test_unknown_optimiser_lists_the_known_ones():
    """A typo names every optimiser the simulator can load."""
    with pytest.raises(ValueError, match="lp.*p-controller|known"):
        make_optimiser("lq")
    with pytest.raises(ValueError, match="kappa"):
        make_optimiser("lp", {"kappa_s": -1.0})


def test_the_lp_rates_measured_reuse_and_splits_identical_engines_evenly(small):
    """Multi-turn chat resends its history, so the engines' token counters show reuse and the
    LP plans each region's pair at capacity × that gain (in ``info``, one value per peer
    group, up to the cap); with ``max_reuse_gain = 1`` it plans at the nominal capacity. The
    two engines of a region are one LP column: equal weights in every period."""
    scenario = small(control={"optimiser": "lp", "period_s": 5.0})
    result = Simulator(scenario, seed=1).run()
    gains = [c.info["reuse_gain"] for c in result.control if "reuse_gain" in c.info]
    assert gains and max(max(g) for g in gains) > 1.0
    assert all(1.0 <= x <= 4.0 for g in gains for x in g)
    assert all(g[0] == g[1] and g[2] == g[3] for g in gains)  # peers share one gain
    for c in result.control:
        assert c.weights[:, 0] == pytest.approx(c.weights[:, 1])
        assert c.weights[:, 2] == pytest.approx(c.weights[:, 3])
    off = small(control={"optimiser": "lp", "period_s": 5.0, "params": {"max_reuse_gain": 1.0}})
    assert all("reuse_gain" not in c.info for c in Simulator(off, seed=1).run().control)
