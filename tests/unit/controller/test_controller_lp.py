"""The routing LP: known optima (spill, shed), warm start, stability, failures, aggregation."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from controller.groups import group_engines
from controller.latency import LatencyProfile
from controller.lp import PRIORITY_SHED_WEIGHT, RoutingProblem, build_lp
from controller.solve import RoutingLP, SolveError
from controller.weights import churn, class_weights

# TTFT-only profile: slopes 0.029, 0.057, 0.114, … s, so thresholds are realistic RTTs
PROFILE = LatencyProfile.seed(0.02, 0.0)
NEAR_S = 0.002


def _two_regions(d_far_s: float, demand: tuple[float, float] = (12.0, 2.0)) -> RoutingProblem:
    """Class 0 sits next to engine A, class 1 next to engine B; both engines have capacity 20."""
    rtt = np.array([[NEAR_S, d_far_s], [d_far_s, NEAR_S]])
    return RoutingProblem.from_profiles(
        demand, [PROFILE, PROFILE], [20.0, 20.0], np.ones((2, 2), dtype=bool), rtt
    )


def _random_problem(rng: np.random.Generator, n_classes: int, n_engines: int, **kw):
    """Seeded fleet: 2 shapes, capacities 8/12/20, RTTs 2–150 ms, demand 50 % of capacity."""
    shapes = [LatencyProfile.seed(0.02, 0.0002), LatencyProfile.seed(0.04, 0.0001)]
    profiles = [shapes[i % 2] for i in range(n_engines)]
    cap = rng.choice([8.0, 12.0, 20.0], n_engines)
    rtt = rng.uniform(0.002, 0.150, (n_classes, n_engines))
    share = rng.dirichlet(np.ones(n_classes))
    demand = 0.5 * 0.95 * cap.sum() * share
    elig = np.ones((n_classes, n_engines), dtype=bool)
    return demand, profiles, cap, elig, rtt, kw


def test_lp_sizes_match_the_formulas() -> None:
    """Columns 2n_A + n_E K + n_G, rows n_G + n_E, nonzeros 4 n_A + n_E K + n_G."""
    elig = np.ones((10, 100), dtype=bool)
    elig[0, :50] = False
    prob = RoutingProblem.from_profiles(
        np.ones(10), [PROFILE] * 100, np.full(100, 10.0), elig, np.full((10, 100), 0.01)
    )
    arrays = build_lp(prob)
    n_a = 950
    assert arrays.n_cols == 2 * n_a + 800 + 10 and arrays.n_rows == 110
    assert arrays.a_index.size == 4 * n_a + 800 + 10 == arrays.a_start[-1]
    assert arrays.a_start.size == arrays.n_cols + 1


@pytest.mark.parametrize("side", ["below", "above"])
def test_near_region_saturates_and_spills_exactly_at_the_threshold(side: str) -> None:
    """Class 0 spills to the far engine iff RTT_far + m_B(idle) < RTT_near + m_A(loaded)."""
    # class 0 alone loads A to ρ = 0.6 (segment [.5, .65]); B carries 2 req/s (segment [0, .3])
    threshold_s = NEAR_S + PROFILE.marginal_latency_s(0.6) - PROFILE.marginal_latency_s(0.1)
    assert 0.05 < threshold_s < 0.15  # a realistic cross-region RTT
    d_far = threshold_s - 0.005 if side == "below" else threshold_s + 0.005
    res = RoutingLP().solve(_two_regions(d_far))
    assert res.status == "Optimal" and np.all(res.shed_rps == 0)
    assert res.x_rps[1, 0] == pytest.approx(0.0, abs=1e-9)  # class 1 never leaves B
    if side == "below":
        # A is filled only up to its cheaper segments (b = 0.5 → 10 req/s); the rest goes far
        assert res.x_rps[0] == pytest.approx([10.0, 2.0], abs=1e-9)
        assert res.marginal_cost_s[0] == pytest.approx(d_far + PROFILE.slopes_s[0])
    else:
        assert res.x_rps[0] == pytest.approx([12.0, 0.0], abs=1e-9)
        assert res.marginal_cost_s[0] == pytest.approx(NEAR_S + PROFILE.slopes_s[2])
    assert res.load_rps == pytest.approx(res.x_rps.sum(axis=0))


def test_over_capacity_sheds_lowest_priority_first() -> None:
    """Demand 12 on capacity 9.5: batch is shed fully, then default; interactive is served."""
    prio = ["batch", "default", "interactive"]
    prob = RoutingProblem.from_profiles(
        [2.0, 4.0, 6.0],
        [PROFILE],
        [10.0],
        np.ones((3, 1), dtype=bool),
        np.full((3, 1), 0.01),
        shed_weight=[PRIORITY_SHED_WEIGHT[p] for p in prio],
    )
    res = RoutingLP().solve(prob)
    assert res.shed_rps == pytest.approx([2.0, 0.5, 0.0], abs=1e-9)
    assert res.load_rps[0] == pytest.approx(9.5)
    weights, sigma = class_weights(res.x_rps, res.shed_rps, prob.demand_rps)
    assert sigma == pytest.approx([1.0, 0.125, 0.0])
    assert weights.tolist() == [[0.0], [1.0], [1.0]]


def test_no_shed_below_capacity(rand) -> None:
    """When demand fits, nothing is shed."""
    demand, profiles, cap, elig, rtt, _ = _random_problem(rand.np, 5, 8)
    res = RoutingLP().solve(RoutingProblem.from_profiles(demand, profiles, cap, elig, rtt))
    assert np.all(res.shed_rps == 0)
    assert res.x_rps.sum(axis=1) == pytest.approx(demand)


def test_unchanged_inputs_resolve_warm_in_zero_iterations(rand) -> None:
    """Same data, re-anchored at the last solution: 0 simplex iterations, identical weights."""
    demand, profiles, cap, elig, rtt, _ = _random_problem(rand.np, 6, 10)
    prob = RoutingProblem.from_profiles(demand, profiles, cap, elig, rtt, kappa_s=0.1)
    lp = RoutingLP()
    first = lp.solve(prob)
    assert not first.warm and first.iterations > 0
    second = lp.solve(prob, first.x_rps)
    third = lp.solve(prob, second.x_rps)
    assert second.warm and second.iterations == 0 and third.iterations == 0
    w1, _ = class_weights(first.x_rps, first.shed_rps, demand)
    w3, _ = class_weights(third.x_rps, third.shed_rps, demand)
    assert np.allclose(w1, w3, rtol=0, atol=1e-12)
    assert churn(w1, w3, demand) < 1e-12


def test_move_penalty_limits_churn_after_a_small_demand_change(rand) -> None:
    """κ > 0 moves about the changed demand only; κ = 0 is free to move more."""
    demand, profiles, cap, elig, rtt, _ = _random_problem(rand.np, 6, 10)
    # identical engines make the κ = 0 optimum degenerate: it may jump between them
    profiles = [PROFILE] * 10
    cap = np.full(10, 12.0)
    rtt[:, 5:] = rtt[:, :5]
    base = RoutingProblem.from_profiles(demand, profiles, cap, elig, rtt, kappa_s=0.2)
    lp = RoutingLP()
    x0 = lp.solve(base).x_rps
    w0, _ = class_weights(x0, np.zeros(6), demand)
    new_demand = demand * (1 + rand.np.uniform(-0.02, 0.02, 6))
    moved = {}
    for kappa in (0.2, 0.0):
        prob = RoutingProblem.from_profiles(new_demand, profiles, cap, elig, rtt, kappa_s=kappa)
        res = RoutingLP().solve(prob, x0)
        w, _ = class_weights(res.x_rps, res.shed_rps, new_demand)
        moved[kappa] = churn(w0, w, new_demand)
    bound = float(np.max(np.abs(new_demand - demand) / new_demand))
    assert moved[0.2] <= bound + 1e-9
    assert moved[0.0] >= moved[0.2] - 1e-9


def test_engine_failure_moves_only_its_own_share(rand) -> None:
    """h = 0 on one engine: its traffic moves, nothing else does (κ > 0)."""
    demand, profiles, cap, elig, rtt, _ = _random_problem(rand.np, 5, 8)
    lp = RoutingLP()
    before = lp.solve(RoutingProblem.from_profiles(demand, profiles, cap, elig, rtt, kappa_s=0.5))
    failed = int(np.argmax(before.load_rps))
    health = np.ones(8)
    health[failed] = 0.0
    after = lp.solve(
        RoutingProblem.from_profiles(demand, profiles, cap, elig, rtt, health=health, kappa_s=0.5),
        before.x_rps,
    )
    assert after.warm
    assert after.load_rps[failed] == pytest.approx(0.0, abs=1e-9)
    delta = after.x_rps - before.x_rps
    others = np.arange(8) != failed
    assert np.all(delta[:, others] >= -1e-9)  # survivors only gain
    assert 0.5 * np.abs(delta).sum() == pytest.approx(before.load_rps[failed], rel=1e-9)


def test_grouped_solve_equals_ungrouped_objective(rand) -> None:
    """Exact aggregation: same optimum, and the capacity-proportional split is feasible for it."""
    rng = rand.np
    shapes = [LatencyProfile.seed(0.02, 0.0002), LatencyProfile.seed(0.05, 0.0001)]
    n_e, n_c = 24, 4
    region = np.arange(n_e) % 3
    profiles = [shapes[(i // 3) % 2] for i in range(n_e)]
    cap = rng.choice([8.0, 12.0, 20.0], n_e)
    health = np.ones(n_e)
    health[[1, 7]] = [0.5, 0.0]
    region_rtt = rng.uniform(0.002, 0.15, (n_c, 3))
    rtt = region_rtt[:, region]
    elig = np.ones((n_c, n_e), dtype=bool)
    elig[3, region == 2] = False
    demand = 0.8 * 0.95 * (cap * health).sum() * rng.dirichlet(np.ones(n_c))
    flat = RoutingProblem.from_profiles(demand, profiles, cap, elig, rtt, health=health)
    full = RoutingLP().solve(flat)
    groups = group_engines(profiles, cap, elig, rtt, health=health)
    assert groups.n_groups == 6
    grouped = RoutingLP().solve(RoutingProblem.from_groups(demand, groups))
    assert grouped.objective == pytest.approx(full.objective, rel=1e-9)
    x = groups.split(grouped.x_rps)
    # the split solution costs the same in the ungrouped model
    util = np.divide(x.sum(axis=0), cap * health, out=np.zeros(n_e), where=health > 0)
    latency_rate = sum(
        c * h * profiles[i].cost_per_capacity(util[i])
        for i, (c, h) in enumerate(zip(cap, health, strict=True))
    )
    assert float((rtt * x).sum() + latency_rate) == pytest.approx(full.objective, rel=1e-9)
    assert np.all(util <= 0.95 + 1e-9)


def test_infeasible_without_shedding_raises_solve_error_with_status() -> None:
    """allow_shed=False above capacity → SolveError('Infeasible'); the next solve still works."""
    lp = RoutingLP()
    prob = _two_regions(0.05, demand=(30.0, 20.0))
    strict = RoutingProblem.from_profiles(
        [30.0, 20.0], [PROFILE] * 2, [20.0, 20.0], np.ones((2, 2), bool),
        prob.network_latency_s, allow_shed=False,
    )  # fmt: skip
    with pytest.raises(SolveError) as info:
        lp.solve(strict)
    assert info.value.status == "Infeasible"
    assert "Infeasible" in str(info.value)
    ok = lp.solve(prob)
    assert ok.shed_rps.sum() == pytest.approx(50.0 - 38.0)
    again = pickle.loads(pickle.dumps(info.value))
    assert again.status == "Infeasible"


def test_zero_time_limit_raises_solve_error() -> None:
    """A 0 s time limit surfaces as SolveError('Time limit reached')."""
    lp = RoutingLP(time_limit_s=0.0)
    with pytest.raises(SolveError) as info:
        lp.solve(_two_regions(0.05))
    assert info.value.status == "Time limit reached"
    lp.time_limit_s = None
    assert lp.solve(_two_regions(0.05)).status == "Optimal"


def test_structure_change_rebuilds(rand) -> None:
    """A new eligibility pattern is built cold; the anchor outside the new pairs is dropped."""
    demand, profiles, cap, elig, rtt, _ = _random_problem(rand.np, 3, 4)
    lp = RoutingLP()
    first = lp.solve(RoutingProblem.from_profiles(demand, profiles, cap, elig, rtt))
    elig2 = elig.copy()
    elig2[0, 0] = False
    second = lp.solve(RoutingProblem.from_profiles(demand, profiles, cap, elig2, rtt), first.x_rps)
    assert not second.warm and second.x_rps[0, 0] == 0.0
    assert second.x_rps.sum(axis=1) == pytest.approx(demand)


def test_problem_validation() -> None:
    """Negative demand, non-convex slopes and a bad anchor are rejected before solving."""
    with pytest.raises(ValueError):
        _two_regions(0.05, demand=(-1.0, 1.0))
    prob = _two_regions(0.05)
    with pytest.raises(ValueError, match="non-decreasing"):
        RoutingProblem(
            demand_rps=prob.demand_rps, eligible=prob.eligible,
            network_latency_s=prob.network_latency_s, capacity_rps=prob.capacity_rps,
            slopes_s=prob.slopes_s[:, ::-1], widths_rho=prob.widths_rho,
            shed_weight=prob.shed_weight,
        )  # fmt: skip
    with pytest.raises(ValueError):
        RoutingLP().solve(prob, x_prev_rps=-np.ones((2, 2)))
