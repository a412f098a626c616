"""Column generation over a working set of pairs: the full LP's optimum, warm reuse, bounds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from controller.latency import LatencyProfile
from controller.lp import RoutingProblem
from controller.sifting import SiftingLP
from controller.solve import RoutingLP
from controller.weights import table_anchor


def _problem(rng: np.random.Generator, n_g: int = 12, n_e: int = 80) -> RoutingProblem:
    """8 regions, RTT 2–150 ms, two shapes, demand 70 % of capacity, κ = 0.2 s."""
    shapes = [LatencyProfile.seed(0.08, 0.009), LatencyProfile.seed(0.05, 0.006)]
    region_rtt = rng.uniform(0.002, 0.150, (8, 8))
    np.fill_diagonal(region_rtt, 0.002)
    cap = rng.choice([8.0, 12.0, 20.0], n_e)
    rtt = region_rtt[np.ix_(np.arange(n_g) % 8, np.arange(n_e) % 8)]
    demand = 0.7 * cap.sum() * rng.dirichlet(np.ones(n_g))
    return RoutingProblem.from_profiles(
        demand,
        [shapes[i % 2] for i in range(n_e)],
        cap,
        np.ones((n_g, n_e), dtype=bool),
        rtt,
        kappa_s=0.2,
    )


def test_sifting_reaches_the_full_lp_optimum_period_after_period() -> None:
    """Cold and over 6 warm periods (demand ±5 %, table anchor): the whole LP's objective, duals
    that price every pair non-negative (LP optimality), and a working set that stays a strict
    subset of the pairs."""
    rng = np.random.default_rng(3)
    prob = _problem(rng)
    sift = SiftingLP(pairs_per_class=6, add_per_class=4)
    res = sift.solve(prob)
    ref = RoutingLP().solve(prob)
    assert res.objective == pytest.approx(ref.objective, rel=1e-9)
    x, d = res.x_rps, prob.demand_rps
    for _ in range(6):
        dem = prob.demand_rps * rng.uniform(0.95, 1.05, d.size)
        p = replace(prob, demand_rps=dem, kappa_s=prob.kappa_matrix_s)
        anchor = table_anchor(x, d, dem)
        res = sift.solve(p, anchor)
        ref = RoutingLP().solve(p, anchor)
        assert res.objective == pytest.approx(ref.objective, rel=1e-9)
        # its duals are feasible for the whole LP: no pair column prices out negative
        assert res.link_dual_s is not None
        d_kappa = p.network_latency_s + p.kappa_matrix_s
        rc = d_kappa - res.marginal_cost_s[:, None] - res.link_dual_s[None, :]
        assert rc.min() >= -1e-7
        assert np.all(res.x_rps[~sift.working] == 0)
        np.testing.assert_allclose(res.x_rps.sum(axis=1) + res.shed_rps, dem, rtol=1e-9)
        x, d = res.x_rps, dem
    assert sift.working is not None and 0 < sift.working.sum() < prob.eligible.sum()


def test_unchanged_data_resolve_in_one_round_and_zero_iterations() -> None:
    """The κ fixed point survives sifting: re-solving at the solution takes 0 pivots, 1 round."""
    prob = _problem(np.random.default_rng(4))
    sift = SiftingLP(pairs_per_class=6, max_working_fraction=1.0)
    first = sift.solve(prob)
    again = sift.solve(prob, first.x_rps)
    assert sift.rounds == 1 and again.warm and again.iterations == 0
    np.testing.assert_allclose(again.x_rps, first.x_rps, rtol=0, atol=1e-9)


def test_exhausted_rounds_fall_back_to_the_whole_lp() -> None:
    """With one pricing round allowed and a tiny working set, the full LP is solved instead."""
    prob = _problem(np.random.default_rng(5))
    sift = SiftingLP(pairs_per_class=1, add_per_class=1, max_rounds=1)
    res = sift.solve(prob)
    assert res.objective == pytest.approx(RoutingLP().solve(prob).objective, rel=1e-9)
    assert sift.rounds == 2 and sift.working is not None and sift.working.all()


def test_adding_columns_keeps_the_basis() -> None:
    """RoutingLP carries its basis when a solve only adds pairs: far fewer pivots than cold."""
    prob = _problem(np.random.default_rng(6))
    half = prob.eligible.copy()
    half[:, 40:] = False
    lp = RoutingLP()
    lp.solve(replace(prob, eligible=half, kappa_s=prob.kappa_matrix_s))
    more = half.copy()
    more[:, 40:44] = True
    sub = replace(prob, eligible=more, kappa_s=prob.kappa_matrix_s)
    carried = lp.solve(sub, primal=True)
    cold = RoutingLP().solve(sub)
    assert not carried.warm
    assert carried.objective == pytest.approx(cold.objective, rel=1e-9)
    assert carried.iterations < cold.iterations / 3


def test_an_overgrown_working_set_restarts_and_stays_exact() -> None:
    """Past ``max_working_fraction`` of the pairs the working set restarts from the cheap pairs
    plus the anchor's support; the solve is still the whole LP's optimum."""
    rng = np.random.default_rng(8)
    prob = _problem(rng)
    sift = SiftingLP(pairs_per_class=6, add_per_class=4, max_working_fraction=0.1)
    res = sift.solve(prob)
    grown = sift.working.sum() if sift.working is not None else 0
    assert grown > 0.1 * prob.eligible.sum()
    dem = prob.demand_rps * rng.uniform(0.95, 1.05, prob.demand_rps.size)
    p = replace(prob, demand_rps=dem, kappa_s=prob.kappa_matrix_s)
    anchor = table_anchor(res.x_rps, prob.demand_rps, dem)
    again = sift.solve(p, anchor)
    assert sift.restarts == 1
    assert again.objective == pytest.approx(RoutingLP().solve(p, anchor).objective, rel=1e-9)


def test_bad_arguments() -> None:
    """Non-positive rounds and a mis-shaped anchor are rejected."""
    with pytest.raises(ValueError, match=">= 1"):
        SiftingLP(max_rounds=0)
    with pytest.raises(ValueError, match="max_working_fraction"):
        SiftingLP(max_working_fraction=0.0)
    prob = _problem(np.random.default_rng(7), n_g=2, n_e=8)
    with pytest.raises(ValueError, match="shape"):
        SiftingLP().solve(prob, np.zeros((3, 8)))
