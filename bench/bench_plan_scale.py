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
    class_weights,
    engine_weights,
    region_engine_weights,
    table_anchor,
    validate_weights,
)
from fastroute.tables import TableSnapshot
from fastroute.tables.wire import encode_snapshot

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
    lp: RoutingLP | SiftingLP
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
    anchor = None
    if state.x_prev is not None and state.demand_prev is not None:
        anchor = table_anchor(state.x_prev, state.demand_prev, demand)
    problem = RoutingProblem.from_groups(demand, g, kappa_s=KAPPA_S)
    t["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    res: SolveResult = state.lp.solve(problem, anchor)
    t["solve_s"] = time.perf_counter() - t0
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


def drifted(fleet: ScaleFleet, demand: FloatArray, moved_fraction: float) -> FloatArray:
    """``moved_fraction`` of the classes move by U(0.97, 1.03) (the others are held, as the
    forecaster holds a class inside its noise dead band)."""
    move = fleet.rng.random(demand.size) < moved_fraction
    return np.where(move, demand * fleet.rng.uniform(0.97, 1.03, demand.size), demand)


def periods(spec: RunSpec) -> tuple[ScaleFleet, RoutingLP | SiftingLP, list[dict[str, Any]]]:
    """The cold period, then ``warm_periods`` after drift, each with DERATED engines derated."""
    fleet = make_fleet(spec.n_regions, spec.n_engines, spec.classes_per_region)
    lp: RoutingLP | SiftingLP = SiftingLP() if use_sifting(fleet.groups().eligible) else RoutingLP()
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
    return {
        "size": f"{spec.n_regions}x{spec.n_engines}x{spec.classes_per_region}",
        "moved_fraction": spec.moved_fraction,
        "regroup": spec.regroup,
        "dense": spec.dense,
        "n_classes": int(fleet.demand_rps.size),
        "pairs_grouped": int(fleet.groups().eligible.sum()),
        "solver": type(lp).__name__,
        "cold": ps[0],
        "warm_median": {k: round(v, 4) for k, v in warm.items()},
        "fanout_bytes": sizes,
        "warm_iterations": [p["iterations"] for p in ps[1:]],
        "tracemalloc_peak_mb": round(peak / 2**20, 1),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def profile_warm(spec: RunSpec, top: int = 15) -> None:
    """cProfile of one warm period (own time, top functions)."""
    fleet = make_fleet(spec.n_regions, spec.n_engines, spec.classes_per_region)
    lp: RoutingLP | SiftingLP = SiftingLP() if use_sifting(fleet.groups().eligible) else RoutingLP()
    state = PeriodState(lp, regroup=spec.regroup, dense=spec.dense)
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
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    moved = [float(v) for v in args.moved.split(",")]
    if not all(0.0 <= m <= 1.0 for m in moved) or args.periods < 1:
        raise SystemExit("--moved fractions must lie in [0, 1] and --periods be >= 1")
    for size in sizes:
        for m in moved:
            spec = RunSpec(
                *size, moved_fraction=m, warm_periods=args.periods, regroup=args.regroup,
                dense=not args.no_dense, fanout=not args.no_fanout,
            )  # fmt: skip
            print(json.dumps(run_size(spec)), flush=True)
    if args.profile:
        last = RunSpec(*sizes[-1], moved_fraction=moved[-1], regroup=args.regroup)
        profile_warm(replace(last, dense=not args.no_dense))


if __name__ == "__main__":
    main()
