"""Routing LP: build + warm solve per control period, grouped and ungrouped, and weight churn.

Instances (docs/algorithms.md §1.6): 8 regions with RTT 2–150 ms, three hardware
types (capacities 8 / 12 / 20 req/s, each its own latency shape), 3 % of engines half-derated, total
demand 70 % of capacity, every class eligible everywhere (dense). A period draws fresh demand
``D · U(0.95, 1.05)`` (setup, untimed) and re-solves (timed) anchored where the controller anchors:
at what the published table sends at the new demand (:func:`controller.weights.table_anchor`).
The ungrouped 50 × 500 period is timed with column generation (:class:`SiftingLP`, the default
figure) and with the whole LP (also anchored at the previous rates, ``solution``, for comparison);
the whole LP's cost is simplex pivots (≈ 1–2 k per period, about one per engine whose load sits on
a segment breakpoint) times a per-pivot cost that grows with the pair columns, not the model update
(≈ 2 ms).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from controller.groups import EngineGroups, group_engines
from controller.latency import LatencyProfile
from controller.lp import RoutingProblem
from controller.sifting import SiftingLP
from controller.solve import RoutingLP, SolveResult
from controller.weights import (
    churn,
    class_weights,
    engine_weights,
    table_anchor,
    validate_weights,
)

N_REGIONS = 8
KAPPA_S = 0.2
SHAPES = [LatencyProfile.seed(t, b) for t, b in ((0.12, 0.012), (0.08, 0.009), (0.05, 0.006))]
CAPACITY_RPS = np.array([8.0, 12.0, 20.0])


@dataclass
class Fleet:
    demand_rps: np.ndarray
    profiles: list[LatencyProfile]
    capacity_rps: np.ndarray
    health: np.ndarray
    eligible: np.ndarray
    rtt_s: np.ndarray
    rng: np.random.Generator

    def drifted(self, noise: float = 0.05) -> np.ndarray:
        return self.demand_rps * self.rng.uniform(1 - noise, 1 + noise, self.demand_rps.size)

    def problem(self, demand_rps: np.ndarray) -> RoutingProblem:
        return RoutingProblem.from_profiles(
            demand_rps, self.profiles, self.capacity_rps, self.eligible, self.rtt_s,
            health=self.health, kappa_s=KAPPA_S,
        )  # fmt: skip

    def groups(self) -> EngineGroups:
        return group_engines(
            self.profiles, self.capacity_rps, self.eligible, self.rtt_s, health=self.health
        )


def make_fleet(n_classes: int, n_engines: int, seed: int = 5) -> Fleet:
    rng = np.random.default_rng(seed)
    region_rtt = rng.uniform(0.002, 0.150, (N_REGIONS, N_REGIONS))
    region_rtt = (region_rtt + region_rtt.T) / 2
    np.fill_diagonal(region_rtt, 0.002)
    engine_region = np.arange(n_engines) % N_REGIONS
    hw = (np.arange(n_engines) // N_REGIONS) % 3
    health = np.where(rng.random(n_engines) < 0.03, 0.5, 1.0)
    cap = CAPACITY_RPS[hw]
    class_region = np.arange(n_classes) % N_REGIONS
    demand = rng.dirichlet(np.ones(n_classes)) * 0.7 * 0.95 * float((cap * health).sum())
    return Fleet(
        demand_rps=demand,
        profiles=[SHAPES[h] for h in hw],
        capacity_rps=cap,
        health=health,
        eligible=np.ones((n_classes, n_engines), dtype=bool),
        rtt_s=region_rtt[np.ix_(class_region, engine_region)],
        rng=rng,
    )


def _warm_period_bench(
    benchmark, fleet: Fleet, rounds: int, anchor: str = "table", solver: str = "simplex"
) -> SolveResult:
    lp = SiftingLP() if solver == "sifting" else RoutingLP()
    state = {"x": lp.solve(fleet.problem(fleet.demand_rps)).x_rps, "d": fleet.demand_rps}

    def setup():
        demand = fleet.drifted()
        x0 = state["x"]
        if anchor == "table":
            x0 = table_anchor(x0, state["d"], demand)
        return (fleet.problem(demand), x0, demand), {}

    def period(problem, x_prev, demand):
        res = lp.solve(problem, x_prev)
        state["x"], state["d"] = res.x_rps, demand
        return res

    res = benchmark.pedantic(period, setup=setup, rounds=rounds, iterations=1, warmup_rounds=1)
    assert res.warm and res.status == "Optimal"
    benchmark.extra_info.update(
        anchor=anchor,
        solver=solver,
        iterations=res.iterations,
        solve_ms=round(1e3 * res.solve_time_s, 3),
        update_ms=round(1e3 * res.build_time_s, 3),
    )
    return res


@pytest.mark.benchmark(group="lp")
def test_lp_10x100_cold(benchmark) -> None:
    """Build the 10 classes × 100 engines LP (2 810 columns) and solve it cold."""
    fleet = make_fleet(10, 100)
    problem = fleet.problem(fleet.demand_rps)
    res = benchmark.pedantic(
        lambda: RoutingLP().solve(problem), rounds=20, iterations=1, warmup_rounds=1
    )
    benchmark.extra_info.update(iterations=res.iterations)


@pytest.mark.benchmark(group="lp")
def test_lp_10x100_warm(benchmark) -> None:
    """One control period, 10 × 100 ungrouped: update vectors after 5 % drift, warm dual simplex."""
    _warm_period_bench(benchmark, make_fleet(10, 100), rounds=30)


@pytest.mark.benchmark(group="lp")
@pytest.mark.parametrize(
    ("solver", "anchor"),
    [("sifting", "table"), ("simplex", "table"), ("simplex", "solution")],
)
def test_lp_50x500_ungrouped_warm(benchmark, solver: str, anchor: str) -> None:
    """One control period, 50 × 500 ungrouped (54 050 columns) after 5 % drift.

    ``simplex``: the whole LP, warm dual simplex. ``sifting``: :class:`SiftingLP`, the same LP
    over a working set of pairs priced out with the duals (same optimum); its warm-up rounds
    grow the working set, the timed periods mostly re-solve it warm.
    """
    _warm_period_bench(benchmark, make_fleet(50, 500), rounds=9, anchor=anchor, solver=solver)


@pytest.mark.benchmark(group="lp")
def test_lp_50x2000_grouped_period(benchmark) -> None:
    """One period over 2 000 engines: group, update the 50 × 24 LP, solve, split to weights."""
    fleet = make_fleet(50, 2000)
    lp = RoutingLP()
    groups = fleet.groups()
    first = lp.solve(RoutingProblem.from_groups(fleet.demand_rps, groups, kappa_s=KAPPA_S))
    state = {"x": first.x_rps, "d": fleet.demand_rps}

    def setup():
        return (fleet.drifted(),), {}

    def period(demand):
        g = fleet.groups()
        x0 = table_anchor(state["x"], state["d"], demand)
        res = lp.solve(RoutingProblem.from_groups(demand, g, kappa_s=KAPPA_S), x0)
        state["x"], state["d"] = res.x_rps, demand
        w, sigma = class_weights(res.x_rps, res.shed_rps, demand)
        w_engine = engine_weights(w, g)
        validate_weights(w_engine, sigma)
        return res, g, w_engine

    res, g, w = benchmark.pedantic(period, setup=setup, rounds=20, iterations=1, warmup_rounds=1)
    assert g.n_groups == 24 and w.shape == (50, 2000)
    assert res.warm and np.all(res.shed_rps == 0)
    benchmark.extra_info.update(
        n_groups=g.n_groups,
        iterations=res.iterations,
        solve_ms=round(1e3 * res.solve_time_s, 3),
    )


@pytest.mark.benchmark(group="lp")
@pytest.mark.parametrize("noise", ["walk", "iid"])
def test_lp_churn_under_demand_noise(benchmark, noise: str) -> None:
    """Weight churn TV per period under 5 % demand noise (grouped 50 × 2 000, κ = 0.2 s).

    ``walk``: D_t = D_{t−1} · U(0.95, 1.05) (the reference's drift step, |ΔD| ≈ 2.5 %);
    ``iid``: D_t = D · U(0.95, 1.05) around a fixed base (consecutive |ΔD| ≈ 3.3 %).
    Target: mean churn ≤ 2 % per period. The instances are seeded, so the figure is
    deterministic and asserted.
    """
    fleet = make_fleet(50, 2000, seed=9)
    groups = fleet.groups()
    lp = RoutingLP()
    res = lp.solve(RoutingProblem.from_groups(fleet.demand_rps, groups, kappa_s=KAPPA_S))
    w0 = engine_weights(class_weights(res.x_rps, res.shed_rps, fleet.demand_rps)[0], groups)
    state = {"x": res.x_rps, "w": w0, "d": fleet.demand_rps, "tv": []}

    def setup():
        base = state["d"] if noise == "walk" else fleet.demand_rps
        return (base * fleet.rng.uniform(0.95, 1.05, base.size),), {}

    def period(demand):
        x0 = table_anchor(state["x"], state["d"], demand)
        r = lp.solve(RoutingProblem.from_groups(demand, groups, kappa_s=KAPPA_S), x0)
        w = engine_weights(class_weights(r.x_rps, r.shed_rps, demand)[0], groups)
        state["tv"].append(churn(state["w"], w, demand))
        state["x"], state["w"], state["d"] = r.x_rps, w, demand

    benchmark.pedantic(period, setup=setup, rounds=30, iterations=1)
    tv = np.asarray(state["tv"])
    benchmark.extra_info.update(
        periods=int(tv.size),
        churn_mean_pct=round(100 * float(tv.mean()), 3),
        churn_max_pct=round(100 * float(tv.max()), 3),
    )
    assert tv.mean() <= 0.02
