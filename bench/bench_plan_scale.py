"""The plan at scale: R regions × E engines × C classes per region, one period timed by stage.

Synthetic fleet (docs/controller.md, "Plan at scale"): ``R`` regions on a random symmetric RTT
matrix (2–150 ms, 2 ms inside a region), ``E / R`` engines per region in three hardware types
(capacities 8 / 12 / 20 req/s, each its own latency shape), so the controller groups them into
``3 R`` groups (region × hardware). ``C`` classes per region (tenant/residency × SLO, as the
controller's ``cluster/model/priority`` rows); a class may use its home region and the
``NEAR`` nearest others (residency), demand 70 % of capacity. A period later demand moves by
``U(0.97, 1.03)`` and ``DERATED`` engines are derated to half health.

Stages of one period, as the planner runs them (:func:`controller.planner._solve_period`):
``group`` (:func:`controller.groups.group_engines`), ``build`` (:meth:`RoutingProblem.from_groups`),
``solve`` (cold the first period, warm with the table anchor the second; column generation above
:data:`controller.planner.SIFTING_MIN_PAIRS` pairs, as the planner chooses), ``rows`` (class →
engine weight rows, validation, the per-engine allocation), ``tables`` (each region's table: its own
class rows × all engines, checked and encoded for the wire, :mod:`fastroute.tables.wire`).

Fan-out (``fanout_*``, with the dense rows): what ``GET /v1/table`` sends the proxies per
generation. Before: the full table (every class × every engine) to every proxy, encoded once.
After (``?cluster=``, :class:`controller.region_tables.EncodedTables`): each region's rows over
the engines they weight, sliced from the published snapshot and encoded once per region, for all
regions. Both in msgpack and JSON (the full table's JSON is skipped above
:data:`FULL_JSON_MAX_CELLS`: its Python lists would need several GB), wall and CPU time.

Run: ``nice -n 5 python bench/bench_plan_scale.py [--sizes 10x1000x10,30x3000x20,100x10000x50]
[--no-fanout] [--profile]``. Prints one JSON line per size and, with ``--profile``, the cProfile
top functions of the warm period at the largest size.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import time
import tracemalloc
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from controller.groups import EngineGroups, group_engines
from controller.latency import LatencyProfile
from controller.lp import RoutingProblem
from controller.planner import SIFTING_MIN_PAIRS
from controller.region_tables import EncodedTables
from controller.sifting import SiftingLP
from controller.solve import RoutingLP, SolveResult
from controller.weights import (
    churn,
    class_weights,
    engine_weights,
    region_engine_weights,
    table_anchor,
    validate_weights,
)
from fastroute.tables import TableSnapshot
from fastroute.tables.wire import encode_snapshot

try:
    from controller.class_groups import AggregatedLP, group_classes
except ImportError:  # a tree from before class aggregation (the "before" figure)
    AggregatedLP = group_classes = None  # type: ignore[assignment,misc]

try:
    from controller.planner import use_sifting
except ImportError:  # a tree from before use_sifting: the rule it had (for the before/after figure)

    def use_sifting(eligible: npt.NDArray[np.bool_]) -> bool:
        return int(eligible.sum()) >= SIFTING_MIN_PAIRS


KAPPA_S = 0.2
#: Largest full table (classes × engines) whose JSON encoding the fan-out measures.
FULL_JSON_MAX_CELLS = 20_000_000
NEAR = 3
DERATED = 5
SHAPES = [LatencyProfile.seed(t, b) for t, b in ((0.12, 0.012), (0.08, 0.009), (0.05, 0.006))]
CAPACITY_RPS = np.array([8.0, 12.0, 20.0])

FloatArray = npt.NDArray[np.float64]


@dataclass
class ScaleFleet:
    """A synthetic fleet, dense as :class:`controller.model.FleetModel` holds it."""

    n_regions: int
    class_region: npt.NDArray[np.intp]
    engine_region: npt.NDArray[np.intp]
    profiles: list[LatencyProfile]
    capacity_rps: FloatArray
    health: FloatArray
    eligible: npt.NDArray[np.bool_]
    rtt_s: FloatArray
    demand_rps: FloatArray
    rng: np.random.Generator
    shed_weight: FloatArray | None = None

    def groups(self, prev: EngineGroups | None = None) -> EngineGroups:
        """Groups at the current health: ``prev`` re-derated when given (the service's path on a
        level change, :meth:`EngineGroups.with_health`), else a full :func:`group_engines`."""
        if prev is not None:
            return prev.with_health(self.capacity_rps, self.health)
        return group_engines(
            self.profiles, self.capacity_rps, self.eligible, self.rtt_s, health=self.health
        )


def make_fleet(
    n_regions: int, n_engines: int, classes_per_region: int, seed: int = 3
) -> ScaleFleet:
    """The fleet described in the module docstring."""
    rng = np.random.default_rng(seed)
    region_rtt = rng.uniform(0.002, 0.150, (n_regions, n_regions))
    region_rtt = (region_rtt + region_rtt.T) / 2
    np.fill_diagonal(region_rtt, 0.002)
    engine_region = np.arange(n_engines) % n_regions
    hw = (np.arange(n_engines) // n_regions) % 3
    cap = CAPACITY_RPS[hw]
    class_region = np.repeat(np.arange(n_regions), classes_per_region)
    # residency: home region and the NEAR nearest others
    near = np.argsort(region_rtt, axis=1)[:, : NEAR + 1]
    region_ok = np.zeros((n_regions, n_regions), dtype=bool)
    np.put_along_axis(region_ok, near, True, axis=1)
    eligible = region_ok[np.ix_(class_region, engine_region)]
    demand = rng.dirichlet(np.ones(class_region.size)) * 0.7 * float(cap.sum())
    return ScaleFleet(
        n_regions=n_regions,
        class_region=class_region,
        engine_region=engine_region,
        profiles=[SHAPES[h] for h in hw],
        capacity_rps=cap,
        health=np.ones(n_engines),
        eligible=eligible,
        rtt_s=region_rtt[np.ix_(class_region, engine_region)],
        demand_rps=demand,
        rng=rng,
    )


def make_model_fleet(
    n_regions: int,
    n_engines: int,
    n_models: int,
    n_priorities: int,
    engine_sets: int,
    seed: int = 3,
) -> ScaleFleet:
    """The fleet of :func:`make_fleet` with the controller's class structure: per region
    ``n_models × n_priorities`` classes (cluster × model × priority). Model ``m`` runs on engine
    set ``m % engine_sets``; an engine hosts two adjacent sets ``{k, k + 1}`` (``k`` cycling over
    the engines of a region independently of the hardware), so sets overlap partly and models of
    one set share their engines. Shed weights ``10^(2 i / (P − 1))`` by priority ``i``; demand
    70 % of capacity, each class's share drawn ∝ the capacity it may use."""
    base = make_fleet(n_regions, n_engines, n_models * n_priorities, seed)
    rng = base.rng
    n_c = base.class_region.size
    class_model = np.tile(np.repeat(np.arange(n_models), n_priorities), n_regions)
    class_priority = np.tile(np.arange(n_priorities), n_regions * n_models)
    k = (np.arange(n_engines) // (3 * n_regions)) % engine_sets
    hosted = np.zeros((engine_sets, n_engines), dtype=bool)
    hosted[k, np.arange(n_engines)] = True
    hosted[(k + 1) % engine_sets, np.arange(n_engines)] = True
    eligible = base.eligible & hosted[class_model % engine_sets]
    usable = (eligible * base.capacity_rps).sum(axis=1)
    share = rng.dirichlet(np.ones(n_c)) * usable
    demand = share / share.sum() * 0.7 * float(base.capacity_rps.sum())
    pi = 10.0 ** (2.0 * np.arange(n_priorities) / max(n_priorities - 1, 1))
    return replace(base, eligible=eligible, demand_rps=demand, shed_weight=pi[class_priority])


def build_fleet(spec: RunSpec) -> ScaleFleet:
    """The fleet of ``spec.structure``: ``uniform`` (:func:`make_fleet`) or ``models``, its
    demand scaled to ``spec.load`` of capacity."""
    if spec.structure == "models":
        fleet = make_model_fleet(
            spec.n_regions, spec.n_engines, spec.n_models, spec.n_priorities, spec.engine_sets
        )
    else:
        fleet = make_fleet(spec.n_regions, spec.n_engines, spec.classes_per_region)
    fleet.demand_rps = fleet.demand_rps * (spec.load / 0.7)
    return fleet


def make_lp(spec: RunSpec, fleet: ScaleFleet) -> Any:
    """The planner's solver: sifting or whole LP by :func:`use_sifting` on the LP it solves,
    over class aggregates (``spec.aggregate``, when the tree has them)."""
    g = fleet.groups()
    if spec.aggregate and AggregatedLP is not None:
        problem = RoutingProblem.from_groups(
            fleet.demand_rps, g, shed_weight=fleet.shed_weight, kappa_s=KAPPA_S
        )
        across = spec.across_priorities
        reps = group_classes(problem, across_priorities=across).representative
        inner = SiftingLP() if use_sifting(g.eligible[reps]) else RoutingLP()
        return AggregatedLP(inner, across_priorities=across)
    return SiftingLP() if use_sifting(g.eligible) else RoutingLP()


def structure_name(spec: RunSpec) -> str:
    if spec.structure == "models":
        return f"models:{spec.n_models}x{spec.n_priorities}/sets{spec.engine_sets}"
    return "uniform"


def components(eligible: npt.NDArray[np.bool_]) -> int:
    """Connected components of the class–group eligibility graph (label propagation)."""
    ci, gi = np.nonzero(eligible)
    n_c, n_g = eligible.shape
    label_c = np.arange(n_c)
    while True:
        label_g = np.full(n_g, n_c)
        np.minimum.at(label_g, gi, label_c[ci])
        new_c = label_c.copy()
        np.minimum.at(new_c, ci, label_g[gi])
        if np.array_equal(new_c, label_c):
            return int(np.unique(label_c).size)
        label_c = new_c


def aggregation_figures(fleet: ScaleFleet, lp: Any) -> dict[str, Any]:
    """Classes, aggregates and independent components of the LP the planner solves."""
    g = fleet.groups()
    classes = getattr(lp, "classes", None)
    elig = g.eligible if classes is None else g.eligible[classes.representative]
    return {
        "aggregated": classes is not None,
        "across_priorities": bool(getattr(classes, "across_priorities", False)),
        "n_lp_classes": int(elig.shape[0]),
        "lp_pairs": int(elig.sum()),
        "components": components(elig),
    }


def region_tables(
    fleet: ScaleFleet, weights: FloatArray, sigma: FloatArray, *, eligible_only: bool
) -> list[bytes]:
    """Each region's wire table: its own class rows × all engines, or × only the engines those
    rows may use (``eligible_only``; a stable column set, unlike the nonzero weights)."""
    n_e = weights.shape[1]
    ids = np.arange(1, n_e + 1, dtype=np.uint64)
    out = []
    for r in range(fleet.n_regions):
        rows = np.flatnonzero(fleet.class_region == r)
        cols = np.flatnonzero(fleet.eligible[rows].any(axis=0)) if eligible_only else slice(None)
        snap = TableSnapshot.validated(
            1,
            ids[cols],
            weights[np.ix_(rows, np.arange(n_e)[cols])],
            class_keys=rows.astype(np.uint64),
            shed_fraction=sigma[rows],
        )
        out.append(encode_snapshot(snap))
    return out


def region_tables_direct(
    fleet: ScaleFleet, g: EngineGroups, wg: FloatArray, sigma: FloatArray
) -> list[bytes]:
    """Each region's table over its eligible engines, straight from the group rows
    (:func:`controller.weights.region_engine_weights`): no dense classes × engines matrix."""
    ids = np.arange(1, fleet.capacity_rps.size + 1, dtype=np.uint64)
    out = []
    for r in range(fleet.n_regions):
        rows = np.flatnonzero(fleet.class_region == r)
        cols = np.flatnonzero(fleet.eligible[rows].any(axis=0))
        w = region_engine_weights(wg, g, rows, cols)
        validate_weights(w, sigma[rows])
        snap = TableSnapshot.validated(
            1, ids[cols], w, class_keys=rows.astype(np.uint64), shed_fraction=sigma[rows]
        )
        out.append(encode_snapshot(snap))
    return out


def _timed(fn: Any) -> tuple[Any, float, float]:
    """``fn()``, its wall and CPU seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def fanout(fleet: ScaleFleet, weights: FloatArray, sigma: FloatArray) -> dict[str, Any]:
    """Bytes and encode cost of one generation's ``GET /v1/table`` answers: the full table
    (before: what every proxy received) vs each region's own block (after, ``?cluster=``)."""
    n_g, n_e = weights.shape
    snap = TableSnapshot.validated(
        2,
        np.arange(1, n_e + 1, dtype=np.uint64),
        weights,
        class_keys=np.arange(n_g, dtype=np.uint64),
        shed_fraction=sigma,
        published_at=1.0,
        meta={"plan_id": 2, "epoch": 1},
    )
    clusters = [f"r{r}" for r in fleet.class_region]
    names = sorted(set(clusters))
    out: dict[str, Any] = {}
    for fmt in ("msgpack", "json"):
        if fmt == "msgpack" or n_g * n_e <= FULL_JSON_MAX_CELLS:
            full, wall, cpu = _timed(lambda f=fmt: encode_snapshot(snap, f))
            out[f"fanout_full_{fmt}_bytes"] = len(full)
            out[f"fanout_full_{fmt}_s"], out[f"fanout_full_{fmt}_cpu_s"] = wall, cpu
            del full
        else:
            out[f"fanout_full_{fmt}_bytes"] = None
        cache = EncodedTables()

        def all_regions(f: str = fmt, c: EncodedTables = cache) -> list[bytes]:
            return [c.encoded(snap, f, r, row_clusters=clusters, declared=names) for r in names]

        blocks, wall, cpu = _timed(all_regions)
        sizes = [len(b) for b in blocks]
        out[f"fanout_region_{fmt}_bytes_mean"] = int(np.mean(sizes))
        out[f"fanout_region_{fmt}_bytes_max"] = max(sizes)
        out[f"fanout_region_{fmt}_bytes_all"] = sum(sizes)
        out[f"fanout_regions_{fmt}_s"], out[f"fanout_regions_{fmt}_cpu_s"] = wall, cpu
        out[f"fanout_per_region_{fmt}_s"] = wall / len(names)
    return out


@dataclass
class PeriodState:
    lp: RoutingLP | SiftingLP | Any
    regroup: str = "health"
    dense: bool = True
    fanout: bool = True
    x_prev: FloatArray | None = None
    demand_prev: FloatArray | None = None
    groups: EngineGroups | None = None


def period(fleet: ScaleFleet, state: PeriodState, demand: FloatArray) -> dict[str, Any]:
    """One planner period, timed per stage (seconds)."""
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    g = fleet.groups(state.groups if state.regroup == "health" else None)
    t["group_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    anchor = None
    if state.x_prev is not None and state.demand_prev is not None:
        anchor = table_anchor(state.x_prev, state.demand_prev, demand)
    problem = RoutingProblem.from_groups(demand, g, shed_weight=fleet.shed_weight, kappa_s=KAPPA_S)
    t["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    res: SolveResult = state.lp.solve(problem, anchor)
    t["solve_s"] = time.perf_counter() - t0
    build_solve_cpu_s = time.process_time() - cpu0
    t0 = time.perf_counter()
    wg, sigma = class_weights(res.x_rps, res.shed_rps, demand, fallback=g.eligible * g.capacity_rps)
    t["class_rows_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    direct = region_tables_direct(fleet, g, wg, sigma)
    t["region_tables_direct_s"] = time.perf_counter() - t0
    state.x_prev, state.demand_prev, state.groups = res.x_rps, demand, g
    out = {
        **{k: round(v, 4) for k, v in t.items()},
        "build_solve_s": round(t["build_s"] + t["solve_s"], 4),
        "build_solve_cpu_s": round(build_solve_cpu_s, 4),
        "plan_region_direct_s": round(sum(t.values()), 4),
        "status": res.status,
        "warm": res.warm,
        "iterations": res.iterations,
        "n_groups": g.n_groups,
        "shed_rps": round(float(res.shed_rps.sum()), 3),
        "table_eligible_cols_bytes_per_region": int(np.mean([len(b) for b in direct])),
    }
    if state.dense:
        out.update(dense_rows(fleet, g, res, wg, sigma, direct, fan=state.fanout))
    return out


def dense_rows(
    fleet: ScaleFleet,
    g: EngineGroups,
    res: SolveResult,
    wg: FloatArray,
    sigma: FloatArray,
    direct: list[bytes],
    *,
    fan: bool = True,
) -> dict[str, Any]:
    """The path the planner takes today: dense classes × engines rows, then per-region tables
    (and, with ``fan``, the fan-out of ``GET /v1/table`` from the published snapshot)."""
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    w = engine_weights(wg, g)
    validate_weights(w, sigma)
    g.split(res.x_rps)
    t["rows_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tables = region_tables(fleet, w, sigma, eligible_only=False)
    t["tables_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    own = region_tables(fleet, w, sigma, eligible_only=True)
    t["tables_eligible_cols_s"] = time.perf_counter() - t0
    sizes = np.array([len(b) for b in tables])
    own_sizes = np.array([len(b) for b in own])
    if [len(b) for b in direct] != own_sizes.tolist():
        raise AssertionError("direct region tables differ in size from the dense path's")
    del tables, own
    return {
        **{k: round(v, 4) for k, v in t.items()},
        "table_bytes_per_region": int(sizes.mean()),
        "table_bytes_all_regions": int(sizes.sum()),
        **(fanout(fleet, w, sigma) if fan else {}),
    }


@dataclass(frozen=True)
class RunSpec:
    """One benchmark run: the size, how many classes move per warm period, the regroup path."""

    n_regions: int
    n_engines: int
    classes_per_region: int
    moved_fraction: float = 1.0
    warm_periods: int = 3
    regroup: str = "health"
    dense: bool = True
    fanout: bool = True
    structure: str = "uniform"
    n_models: int = 10
    n_priorities: int = 5
    engine_sets: int = 4
    aggregate: bool = True
    across_priorities: bool = True
    load: float = 0.7


def drifted(fleet: ScaleFleet, demand: FloatArray, moved_fraction: float) -> FloatArray:
    """``moved_fraction`` of the classes move by U(0.97, 1.03) (the others are held, as the
    forecaster holds a class inside its noise dead band)."""
    move = fleet.rng.random(demand.size) < moved_fraction
    return np.where(move, demand * fleet.rng.uniform(0.97, 1.03, demand.size), demand)


def periods(spec: RunSpec) -> tuple[ScaleFleet, RoutingLP | SiftingLP, list[dict[str, Any]]]:
    """The cold period, then ``warm_periods`` after drift, each with DERATED engines derated."""
    fleet = build_fleet(spec)
    lp = make_lp(spec, fleet)
    state = PeriodState(lp, regroup=spec.regroup, dense=spec.dense, fanout=spec.fanout)
    out = [period(fleet, state, fleet.demand_rps)]
    demand = fleet.demand_rps
    for _ in range(spec.warm_periods):
        demand = drifted(fleet, demand, spec.moved_fraction)
        fleet.health[fleet.rng.choice(spec.n_engines, DERATED, replace=False)] = 0.5
        out.append(period(fleet, state, demand))
    return fleet, lp, out


def run_size(spec: RunSpec) -> dict[str, Any]:
    """Timed periods (no tracing), then a traced repeat for the allocation peak."""
    fleet, lp, ps = periods(spec)
    warm = {k: float(np.median([p[k] for p in ps[1:]])) for k in ps[1] if k.endswith("_s")}
    sizes = {k: v for k, v in ps[-1].items() if k.startswith("fanout_") and "bytes" in k}
    tracemalloc.start()
    periods(replace(spec, warm_periods=1, fanout=False))  # the peak of the planner's path
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    agg = aggregation_figures(fleet, lp)
    return {
        "size": f"{spec.n_regions}x{spec.n_engines}x{spec.classes_per_region}",
        "structure": structure_name(spec),
        **agg,
        "moved_fraction": spec.moved_fraction,
        "load": spec.load,
        "regroup": spec.regroup,
        "dense": spec.dense,
        "n_classes": int(fleet.demand_rps.size),
        "pairs_grouped": int(fleet.groups().eligible.sum()),
        "solver": type(getattr(lp, "inner", lp)).__name__,
        "cold": ps[0],
        "warm_median": {k: round(v, 4) for k, v in warm.items()},
        "fanout_bytes": sizes,
        "warm_iterations": [p["iterations"] for p in ps[1:]],
        "tracemalloc_peak_mb": round(peak / 2**20, 1),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def churn_run(spec: RunSpec, n_periods: int, seed: int) -> dict[str, Any]:
    """Weight churn of the class rows under i.i.d. 5 % demand noise around the base demand:
    no aggregation, by priority and across priorities, each from the same cold start and noise.

    Churn is :func:`controller.weights.churn` of consecutive class × group weight rows (demand
    weighted total variation); also the mean change of the shed fractions (demand weighted).
    """
    size = f"{spec.n_regions}x{spec.n_engines}x{spec.classes_per_region}"
    out: dict[str, Any] = {
        "size": size, "structure": structure_name(spec), "load": spec.load, "seed": seed
    }  # fmt: skip
    for name in ("none", "by_priority", "across"):
        fleet = build_fleet(spec)
        g = fleet.groups()
        rng = np.random.default_rng(seed)
        lp = make_lp(
            replace(spec, aggregate=name != "none", across_priorities=name == "across"), fleet
        )
        d = fleet.demand_rps
        r = lp.solve(
            RoutingProblem.from_groups(d, g, shed_weight=fleet.shed_weight, kappa_s=KAPPA_S)
        )
        w, sigma = class_weights(r.x_rps, r.shed_rps, d)
        tv, dsigma = [], []
        for _ in range(n_periods):
            d1 = fleet.demand_rps * rng.uniform(0.95, 1.05, d.size)
            problem = RoutingProblem.from_groups(
                d1, g, shed_weight=fleet.shed_weight, kappa_s=KAPPA_S
            )
            r = lp.solve(problem, table_anchor(r.x_rps, d, d1))
            w1, sigma1 = class_weights(r.x_rps, r.shed_rps, d1)
            tv.append(churn(w, w1, d1))
            dsigma.append(float(np.abs(sigma1 - sigma) @ d1 / d1.sum()))
            d, w, sigma = d1, w1, sigma1
        out[name] = {
            "churn_mean_pct": round(100 * float(np.mean(tv)), 3),
            "churn_max_pct": round(100 * float(np.max(tv)), 3),
            "shed_fraction_change_pct": round(100 * float(np.mean(dsigma)), 3),
            "shed_rps": round(float(r.shed_rps.sum()), 1),
        }
    return out


def profile_warm(spec: RunSpec, top: int = 15) -> None:
    """cProfile of one warm period (own time, top functions)."""
    fleet = build_fleet(spec)
    state = PeriodState(make_lp(spec, fleet), regroup=spec.regroup, dense=spec.dense)
    period(fleet, state, fleet.demand_rps)
    demand = drifted(fleet, fleet.demand_rps, spec.moved_fraction)
    fleet.health[fleet.rng.choice(spec.n_engines, DERATED, replace=False)] = 0.5
    prof = cProfile.Profile()
    prof.enable()
    period(fleet, state, demand)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(","):
        r, e, c = (int(v) for v in part.lower().split("x"))
        if r < 1 or e < 3 * r or c < 1:
            raise SystemExit(f"bad size {part!r}: need R >= 1, E >= 3 R, C >= 1")
        out.append((r, e, c))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sizes", default="10x1000x10,30x3000x20,100x10000x50")
    ap.add_argument("--moved", default="1.0", help="fractions of classes moving per period")
    ap.add_argument("--periods", type=int, default=3, help="warm periods per run (median)")
    ap.add_argument(
        "--regroup", choices=["health", "full"], default="health",
        help="health: re-derate the partition (the service now); full: group_engines each period",
    )  # fmt: skip
    ap.add_argument(
        "--no-dense", action="store_true",
        help="skip the dense classes x engines rows (the planner's path today)",
    )  # fmt: skip
    ap.add_argument(
        "--no-fanout", action="store_true",
        help="skip the GET /v1/table fan-out figures (full table vs per-region blocks)",
    )  # fmt: skip
    ap.add_argument(
        "--structure", choices=["uniform", "models"], default="uniform",
        help="classes per region: uniform (C alike) or models (cluster x model x priority; "
        "C is replaced by --models x --priorities)",
    )  # fmt: skip
    ap.add_argument("--load", type=float, default=0.7, help="demand / capacity")
    ap.add_argument("--models", type=int, default=10)
    ap.add_argument("--priorities", type=int, default=5)
    ap.add_argument("--engine-sets", type=int, default=4, help="distinct model engine sets")
    ap.add_argument(
        "--no-aggregate", action="store_true", help="solve every class (no class aggregation)"
    )
    ap.add_argument(
        "--by-priority", action="store_true",
        help="aggregate only classes of equal shed weight (not across priorities)",
    )  # fmt: skip
    ap.add_argument(
        "--churn", type=int, default=0, metavar="N",
        help="instead of timing: churn over N noisy periods, none / by priority / across",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=7, help="demand noise seed of --churn")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if min(args.models, args.priorities, args.engine_sets) < 1:
        raise SystemExit("--models, --priorities and --engine-sets must be >= 1")
    sizes = parse_sizes(args.sizes)
    moved = [float(v) for v in args.moved.split(",")]
    if not all(0.0 <= m <= 1.0 for m in moved) or args.periods < 1:
        raise SystemExit("--moved fractions must lie in [0, 1] and --periods be >= 1")
    for size in sizes:
        for m in moved:
            spec = RunSpec(
                *size, moved_fraction=m, warm_periods=args.periods, regroup=args.regroup,
                dense=not args.no_dense, fanout=not args.no_fanout, structure=args.structure,
                n_models=args.models,
                n_priorities=args.priorities, engine_sets=args.engine_sets,
                aggregate=not args.no_aggregate, across_priorities=not args.by_priority,
                load=args.load,
            )  # fmt: skip
            if spec.structure == "models":
                spec = replace(spec, classes_per_region=args.models * args.priorities)
            result = churn_run(spec, args.churn, args.seed) if args.churn else run_size(spec)
            print(json.dumps(result), flush=True)
    if args.profile:
        last = RunSpec(
            *sizes[-1], moved_fraction=moved[-1], regroup=args.regroup, dense=not args.no_dense,
            structure=args.structure, n_models=args.models, n_priorities=args.priorities,
            engine_sets=args.engine_sets, aggregate=not args.no_aggregate,
            across_priorities=not args.by_priority, load=args.load,
        )  # fmt: skip
        profile_warm(last)


if __name__ == "__main__":
    main()
