"""Exact class aggregation: partition keys, and aggregated vs class LP on real HiGHS."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from controller.class_groups import AggregatedLP, aggregate_problem, group_classes
from controller.latency import LatencyProfile
from controller.lp import RoutingProblem
from controller.sifting import SiftingLP
from controller.solve import RoutingLP, SolveResult
from controller.weights import table_anchor

SHAPES = [LatencyProfile.seed(t, b) for t, b in ((0.12, 0.012), (0.05, 0.006))]


def random_problem(
    rng: np.random.Generator, n_types: int = 4, n_engines: int = 6, *, load: float = 0.8
) -> tuple[RoutingProblem, np.ndarray]:
    """Classes drawn from ``n_types`` row types (1–3 copies each, shuffled), derated engines,
    per-pair κ and mixed priorities; returns the problem and each class's type."""
    copies = rng.integers(1, 4, n_types)
    types = rng.permutation(np.repeat(np.arange(n_types), copies))
    elig_t = rng.random((n_types, n_engines)) < 0.6
    elig_t[np.arange(n_types), rng.integers(0, n_engines, n_types)] = True
    dist_t = rng.uniform(0.002, 0.15, (n_types, n_engines))
    kappa_t = rng.uniform(0.05, 0.3, (n_types, n_engines))
    pi_t = rng.choice([1.0, 10.0, 100.0], n_types)
    cap = rng.choice([8.0, 12.0, 20.0], n_engines)
    health = np.where(rng.random(n_engines) < 0.3, 0.5, 1.0)
    demand = rng.dirichlet(np.ones(types.size)) * load * float(cap.sum())
    problem = RoutingProblem.from_profiles(
        demand,
        [SHAPES[i % 2] for i in range(n_engines)],
        cap,
        elig_t[types],
        dist_t[types],
        health=health,
        shed_weight=pi_t[types],
        kappa_s=kappa_t[types],
    )
    return problem, types


def class_objective(problem: RoutingProblem, res: SolveResult, x_prev: np.ndarray | None) -> float:
    """The class LP's objective at (x, shed): latency + move + segment + shed cost."""
    x, shed = res.x_rps, res.shed_rps
    x0 = np.zeros_like(x) if x_prev is None else x_prev * problem.eligible
    elig = problem.eligible
    route = float((problem.network_latency_s * x)[elig].sum())
    move = float((problem.kappa_matrix_s * np.abs(x - x0))[elig].sum())
    width = problem.widths_rho * problem.capacity_rps[:, None]
    start = np.cumsum(width, axis=1) - width
    fill = np.clip(x.sum(axis=0)[:, None] - start, 0.0, width)
    seg = float((problem.slopes_s * fill).sum())
    return route + move + seg + float(problem.shed_penalty_s() @ shed)


def test_classes_group_by_eligibility_distance_kappa_and_priority() -> None:
    """Same rows ⇒ one aggregate; any differing coefficient (on an eligible pair) splits it."""
    elig = np.array([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 1], [1, 1, 0], [1, 1, 0]], bool)
    dist = np.full((6, 3), 0.01)
    dist[4, 1] = 0.02  # distance differs
    dist[1, 2] = 0.09  # differs only where not eligible: ignored
    kappa = np.full((6, 3), 0.2)
    kappa[5, 0] = 0.3  # κ differs
    problem = RoutingProblem.from_profiles(
        np.ones(6), [SHAPES[0]] * 3, np.full(3, 10.0), elig, dist,
        shed_weight=np.array([10.0, 10.0, 1.0, 10.0, 10.0, 10.0]), kappa_s=kappa,
    )  # fmt: skip
    cg = group_classes(problem)
    assert cg.group_of_class.tolist() == [0, 0, 1, 2, 3, 4]
    assert cg.representative.tolist() == [0, 2, 3, 4, 5]
    agg = aggregate_problem(problem, cg)
    np.testing.assert_allclose(agg.demand_rps, [2.0, 1.0, 1.0, 1.0, 1.0])
    assert agg.shed_penalty_base() == problem.shed_penalty_base()
    x = np.arange(18.0).reshape(6, 3)
    np.testing.assert_allclose(cg.total(x)[0], x[0] + x[1])
    split = cg.split(cg.total(x), problem.demand_rps, agg.demand_rps)
    np.testing.assert_allclose(split[:2], [(x[0] + x[1]) / 2] * 2)


@pytest.mark.parametrize("seed", range(8))
def test_aggregated_lp_matches_the_class_lp(seed: int) -> None:
    """Random instances with duplicate classes, derated engines and shedding (load 0.8 or 1.3):
    the aggregated LP's optimum is the class LP's, cold and over warm periods anchored at the
    table in force (anchors proportional to demand within each aggregate); every class's row
    and shed fraction are its aggregate's; per-aggregate sums of the class LP's solution equal
    the aggregated solution (its optimum is unique on random data); the class LP's own per-class
    split may differ (a swap between two interchangeable classes keeps every cost), so the
    split is checked to attain the class optimum under the class objective."""
    rng = np.random.default_rng(seed)
    problem, types = random_problem(rng, load=0.8 if seed % 2 else 1.3)
    agg_lp, full_lp = AggregatedLP(RoutingLP()), RoutingLP()
    x_prev = demand_prev = None
    for _period in range(3):
        if x_prev is not None:
            demand = problem.demand_rps * rng.uniform(0.9, 1.1, problem.n_classes)
            problem = RoutingProblem(
                demand, problem.eligible, problem.network_latency_s, problem.capacity_rps,
                problem.slopes_s, problem.widths_rho, problem.shed_weight, problem.kappa_s,
            )  # fmt: skip
        anchor = None if x_prev is None else table_anchor(x_prev, demand_prev, problem.demand_rps)
        ra = agg_lp.solve(problem, anchor)
        rf = full_lp.solve(problem, anchor)
        scale = max(1.0, abs(rf.objective))
        assert abs(ra.objective - rf.objective) <= 1e-6 * scale
        assert abs(class_objective(problem, ra, anchor) - rf.objective) <= 1e-6 * scale
        cg = agg_lp.classes
        assert cg is not None and cg.n_groups == np.unique(types).size
        np.testing.assert_allclose(cg.total(rf.x_rps), cg.total(ra.x_rps), atol=1e-6)
        np.testing.assert_allclose(cg.total(rf.shed_rps), cg.total(ra.shed_rps), atol=1e-6)
        # every member's weight row and shed fraction are its aggregate's
        w = ra.x_rps / np.maximum(ra.x_rps.sum(axis=1, keepdims=True), 1e-12)
        sigma = ra.shed_rps / problem.demand_rps
        rep = cg.representative[cg.group_of_class]
        np.testing.assert_allclose(w, w[rep], atol=1e-9)
        np.testing.assert_allclose(sigma, sigma[rep], atol=1e-9)
        np.testing.assert_allclose(ra.load_rps, rf.load_rps, atol=1e-6)
        x_prev, demand_prev = ra.x_rps, problem.demand_rps


def test_the_kappa_fixed_point_keeps_every_class_row() -> None:
    """At unchanged demand, anchored at the split, the class LP moves nothing: its per-class
    rows (unique there: any move costs κ) equal the aggregated solution's, within 1e-6."""
    problem, _ = random_problem(np.random.default_rng(11), n_types=3, n_engines=5)
    first = AggregatedLP(RoutingLP()).solve(problem)
    rf = RoutingLP().solve(problem, first.x_rps)
    np.testing.assert_allclose(rf.x_rps, first.x_rps, atol=1e-6)
    np.testing.assert_allclose(rf.shed_rps, first.shed_rps, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_anchors_that_differ_within_an_aggregate_are_within_the_stated_bound(seed: int) -> None:
    """Members' previous rows not proportional (e.g. an unaggregated anchor): the aggregated LP
    is a relaxation (f_a* ≤ f*) and the split is feasible with
    f(split) − f* ≤ κ Σ |x⁰_g − (D_g/D_a) x⁰_a| (the module doc's bound)."""
    rng = np.random.default_rng(100 + seed)
    problem, _ = random_problem(rng, n_types=3, n_engines=5)
    anchor = rng.uniform(0.0, 3.0, problem.eligible.shape) * problem.eligible
    ra = AggregatedLP(RoutingLP()).solve(problem, anchor)
    rf = RoutingLP().solve(problem, anchor)
    cg = group_classes(problem)
    d_agg = cg.total(problem.demand_rps)
    proportional = cg.split(cg.total(anchor), problem.demand_rps, d_agg)
    bound = float((problem.kappa_matrix_s * np.abs(anchor - proportional)).sum())
    tol = 1e-6 * max(1.0, abs(rf.objective))
    f_split = class_objective(problem, ra, anchor)
    assert ra.objective <= rf.objective + tol
    assert rf.objective - tol <= f_split <= rf.objective + bound + tol
    np.testing.assert_allclose(ra.x_rps.sum(axis=1) + ra.shed_rps, problem.demand_rps)


def test_the_partition_is_kept_while_the_rows_are_the_same() -> None:
    """A new demand or capacity keeps the cached partition (and the inner LP re-solves warm);
    new rows re-partition; a wrongly shaped anchor is refused."""
    problem, _ = random_problem(np.random.default_rng(3))
    lp = AggregatedLP(RoutingLP())
    first = lp.solve(problem)
    cached = lp.classes
    again = RoutingProblem(
        problem.demand_rps * 1.01, problem.eligible, problem.network_latency_s,
        problem.capacity_rps * 0.9, problem.slopes_s, problem.widths_rho, problem.shed_weight,
        problem.kappa_s,
    )  # fmt: skip
    res = lp.solve(again, first.x_rps)
    assert lp.classes is cached and res.warm
    changed = RoutingProblem(
        again.demand_rps, again.eligible, again.network_latency_s * 1.5, again.capacity_rps,
        again.slopes_s, again.widths_rho, again.shed_weight, again.kappa_s,
    )  # fmt: skip
    lp.solve(changed, res.x_rps)
    assert lp.classes is not cached
    with pytest.raises(ValueError, match="x_prev_rps"):
        lp.solve(changed, res.x_rps[:, :2])


def with_priorities(problem: RoutingProblem, rng: np.random.Generator) -> RoutingProblem:
    """The same rows with every class's shed weight drawn anew (duplicates now differ in π)."""
    return replace(problem, shed_weight=rng.choice([1.0, 10.0, 100.0], problem.n_classes))


def staircase_bound(problem: RoutingProblem, res: SolveResult, anchor: np.ndarray) -> float:
    """κ Σ |x⁰_g − s_g x⁰_a|, s_g = routed_g / routed_a: the move term the split may overpay."""
    cg = group_classes(problem, across_priorities=True)
    routed = problem.demand_rps - res.shed_rps
    proportional = cg.split(cg.total(anchor), routed, cg.total(routed))
    return float((problem.kappa_matrix_s * np.abs(anchor - proportional)).sum())


@pytest.mark.parametrize("seed", range(8))
def test_aggregating_across_priorities_is_exact_while_shed_fractions_hold(seed: int) -> None:
    """Duplicates that differ only in π, aggregated with one shed column per member: the cold
    solve matches the class LP, and so does every warm period whose shed fractions held (all of
    them at 30 % load); otherwise the optimum is matched up to the stated move-term bound, the
    aggregated LP is a relaxation, members shed lowest priority first and share their
    aggregate's weight row."""
    rng = np.random.default_rng(200 + seed)
    overload = seed % 2 == 0
    base, _ = random_problem(rng, load=1.3 if overload else 0.3)
    problem = with_priorities(base, rng)
    agg_lp, full_lp = AggregatedLP(RoutingLP(), across_priorities=True), RoutingLP()
    x_prev = demand_prev = sigma_prev = None
    exact_warm = 0
    for period in range(3):
        if x_prev is not None:
            demand = problem.demand_rps * rng.uniform(0.9, 1.1, problem.n_classes)
            problem = replace(problem, demand_rps=demand)
        anchor = None if x_prev is None else table_anchor(x_prev, demand_prev, problem.demand_rps)
        ra = agg_lp.solve(problem, anchor)
        rf = full_lp.solve(problem, anchor)
        cg = agg_lp.classes
        assert cg is not None and cg.across_priorities
        assert cg.n_groups < problem.n_classes
        tol = 1e-6 * max(1.0, abs(rf.objective))
        f_split = class_objective(problem, ra, anchor)
        assert ra.objective <= rf.objective + tol
        np.testing.assert_allclose(ra.x_rps.sum(axis=1) + ra.shed_rps, problem.demand_rps)
        sigma = ra.shed_rps / problem.demand_rps
        if period == 0 or np.allclose(sigma, sigma_prev, atol=1e-9):
            assert rf.objective - tol <= f_split <= rf.objective + tol
            exact_warm += period > 0
        else:
            bound = staircase_bound(problem, ra, anchor)
            assert rf.objective - tol <= f_split <= rf.objective + bound + tol
        w = ra.x_rps / np.maximum(ra.x_rps.sum(axis=1, keepdims=True), 1e-12)
        xa = cg.total(ra.x_rps)
        w_agg = (xa / np.maximum(xa.sum(axis=1, keepdims=True), 1e-12))[cg.group_of_class]
        routes = ra.x_rps.sum(axis=1) > 1e-9
        np.testing.assert_allclose(w[routes], w_agg[routes], atol=1e-9)
        # inside an aggregate a class sheds only if every lower priority sheds in full
        for a in range(cg.n_groups):
            members = np.flatnonzero(cg.group_of_class == a)
            pi = problem.shed_weight[members]
            for i in members[sigma[members] > 1e-9]:
                lower = members[pi < problem.shed_weight[i]]
                assert np.all(sigma[lower] > 1 - 1e-9)
        x_prev, demand_prev, sigma_prev = ra.x_rps, problem.demand_rps, sigma
    assert np.all(ra.marginal_cost_s <= problem.shed_penalty_s() + 1e-9)
    assert overload or exact_warm == 2  # below capacity nothing is shed: every period exact


def test_shed_segments_are_validated_and_keep_the_structure_warm() -> None:
    """Shed segment arrays come together and index the classes; an aggregated problem with the
    same partition re-solves warm."""
    problem, _ = random_problem(np.random.default_rng(5))
    with pytest.raises(ValueError, match="together"):
        replace(problem, shed_segment_class=np.zeros(2, dtype=np.intp))
    with pytest.raises(ValueError, match="index"):
        replace(
            problem,
            shed_segment_class=np.array([0, problem.n_classes]),
            shed_segment_weight=np.ones(2),
            shed_segment_rps=np.ones(2),
        )
    lp = AggregatedLP(RoutingLP(), across_priorities=True)
    first = lp.solve(with_priorities(problem, np.random.default_rng(1)))
    res = lp.solve(replace(problem, demand_rps=problem.demand_rps * 1.02), first.x_rps)
    assert res.warm
    with pytest.raises(ValueError, match="already"):
        group_classes(aggregate_problem(problem, lp.classes))


@pytest.mark.parametrize("across", [False, True])
def test_column_generation_inside_the_aggregated_lp(across: bool) -> None:
    """SiftingLP as the inner solver (a small first working set, so pairs enter by pricing; shed
    columns per member when across priorities): the class LP's objective, cold and warm."""
    rng = np.random.default_rng(21)
    problem, _ = random_problem(rng, n_types=5, n_engines=12, load=1.1)
    problem = with_priorities(problem, rng)
    lp = AggregatedLP(SiftingLP(pairs_per_class=1, add_per_class=1), across_priorities=across)
    full = RoutingLP()
    anchor = None
    for _period in range(2):
        ra, rf = lp.solve(problem, anchor), full.solve(problem, anchor)
        assert abs(ra.objective - rf.objective) <= 1e-6 * max(1.0, abs(rf.objective))
        assert lp.inner.rounds > 1 or _period > 0
        anchor = ra.x_rps
        problem = replace(problem, demand_rps=problem.demand_rps * 1.01)
