"""The controller's optimisers as callables for the simulator (``fastroute sim``).

The simulator (``fastroute.sim``) never imports ``controller``; it loads this module by
name and calls :func:`make_optimiser`. Each optimiser is a closure over the controller's
own objects — :class:`~controller.solve.RoutingLP` on a
:class:`~controller.lp.RoutingProblem` (with :class:`~controller.health.HealthTracker`
derating when asked), or the :class:`~controller.pcontroller.ProportionalController`
baseline — that turns a ``fastroute.sim.control.ControlInput`` into a
``ControlOutput``. Nothing here re-implements the LP or the P-controller.

Optimisers
----------
``lp``
    The routing LP, fed forward and grouped as the service groups it (identical engines
    are one LP column whose rate splits ∝ capacity, :func:`~controller.groups.group_engines`):
    the observed (lagged) class demand, a seed latency
    profile per engine from the model's idle latencies, capacities × reuse gain × health,
    network RTTs, and the L1 anchor at what the published table sends at the new demand
    (:func:`~controller.weights.table_anchor`, as the service does); the forecast the LP
    sees is the forecaster's held one, the shed fractions are taken at its live one
    (:func:`~controller.weights.shed_at_demand`, as the service does). Tunables: ``kappa_s`` (move
    penalty, s per req/s moved; default the service's ``ControllerConfig.kappa_s``),
    ``allow_shed`` (default True),
    ``derate`` (default False: health derating from the window's latency residuals and
    error rates), ``derating`` (a dict of :class:`fastroute.config.DeratingConfig`
    fields), ``demand_alpha`` and ``peak_periods`` (the service's
    :class:`~controller.demand.DemandForecaster`: EWMA weight, default 0.3, and recent-peak
    window, default 3 periods), ``demand_deadband_z`` (its dead band in Poisson standard
    errors, default 2), ``min_demand_rps`` (floor per class so an idle class
    keeps a row; default 0.01), ``max_reuse_gain`` (the service's
    ``controller.max_reuse_gain``, default 4: capacities × the peer groups' prefix-reuse
    gain from the engines' token counters over the last ``reuse_window_s`` = 60 s,
    :mod:`controller.reuse`; 1 plans with the nominal capacities), ``reuse_decode_cost``
    (its ``β``, default :data:`controller.reuse.DECODE_TOKEN_COST`).
``p-controller``
    The proportional baseline of docs/algorithms.md §8.1 on per-engine latency:
    ``gain`` (K, default 0.5), ``ewma_alpha`` (a, default 0.3), ``min_weight``
    (default 1e-3), ``signal`` (``"e2e"`` per-request latency, ``"ttft"`` or
    ``"tbot"``; default ``"e2e"``). Its weights are shared by every class and masked by
    eligibility. Signal lag is the simulator's ``lag_periods`` (the controller's own
    delay line is kept at 0 so the lag is not applied twice).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import numpy as np

from controller.demand import DemandForecaster
from controller.groups import group_engines, regroup_rates
from controller.health import HealthTracker, HealthWindow
from controller.latency import LatencyProfile
from controller.lp import RoutingProblem
from controller.pcontroller import ProportionalController
from controller.reuse import DECODE_TOKEN_COST, group_reuse_gains
from controller.solve import RoutingLP, SolveError
from controller.weights import class_weights, engine_weights, shed_at_demand, table_anchor
from fastroute.config import ControllerConfig, DeratingConfig
from fastroute.signals.prefix_cache import DEFAULT_WINDOW_S
from fastroute.signals.reports import REPORT_VERSION, ClassDemand, Report

__all__ = ["OPTIMISERS", "SimTable", "make_optimiser", "lp_optimiser", "p_controller_optimiser"]


class SimTable(NamedTuple):
    """What an optimiser returns (``fastroute.sim.control.ControlOutput``'s fields; the
    simulator reads them by name, so this module needs nothing from ``fastroute.sim``)."""

    weights: np.ndarray
    shed_fraction: np.ndarray
    info: dict[str, Any]


def _health_window(w: Any) -> HealthWindow:
    return HealthWindow(
        w.ttft_count.copy(),
        w.ttft_sum_s.copy(),
        w.tbot_count.copy(),
        w.tbot_sum_s.copy(),
        w.attempts.copy(),
        w.errors.copy(),
        w.load_rps.copy(),
    )


def _forecast(
    forecaster: DemandForecaster, inp: Any, floor_rps: float
) -> tuple[np.ndarray, np.ndarray]:
    """Feed the window's per-class arrivals to the service's forecaster, as one report per
    source region, and return its held forecast and its level."""
    start = inp.now_s - inp.period_s
    counts = np.rint(np.asarray(inp.demand_rps) * inp.period_s).astype(int)
    for region in dict.fromkeys(inp.class_sources):
        classes = [
            ClassDemand(class_key=g, requests=int(counts[g]))
            for g, src in enumerate(inp.class_sources)
            if src == region
        ]
        report = Report(
            version=REPORT_VERSION,
            source_cluster=region,
            worker_id=f"sim-{region}",
            window_start_s=start,
            window_end_s=inp.now_s,
            classes=classes,
            engines=[],
        )
        forecaster.observe(report, inp.now_s)
    forecaster.update(inp.now_s)
    n = len(inp.class_labels)
    floor = np.full(n, floor_rps)
    return forecaster.forecast(floor, floor), forecaster.level(floor, floor)


def _profiles(inp: Any) -> list[LatencyProfile]:
    return [
        LatencyProfile.seed(
            float(ttft), float(tbot), mean_output_tokens=float(inp.mean_output_tokens)
        )
        for ttft, tbot in zip(inp.idle_ttft_s, inp.idle_tbot_s, strict=True)
    ]


def _derated_health(
    state: dict[str, Any], inp: Any, derating: DeratingConfig, info: dict[str, Any]
) -> np.ndarray:
    """Step the optimiser's health tracker (made on first use) on the window; return the health
    factors and note them, and any level changes, in ``info``."""
    tracker = state["tracker"]
    if tracker is None:
        tracker = state["tracker"] = HealthTracker(
            state["profiles"], inp.capacity_rps, derating, engine_names=inp.engine_names
        )
    changes = tracker.update(_health_window(inp.window), inp.now_s)
    health = tracker.health.copy()
    info["health"] = health.tolist()
    if changes:
        info["health_changes"] = [str(c) for c in changes]
    return health


def _reuse_gain(
    history: deque[tuple[float, np.ndarray]],
    inp: Any,
    reuse: tuple[float, float, float],
    info: dict[str, Any],
) -> np.ndarray:
    """Per engine, its peer group's reuse gain over the last ``window_s`` of token counters
    (as the service's prefix-hit window: the newest sample at least ``window_s`` old is the
    base); peers = engines of one model, capacity and idle latencies. ``reuse`` is
    ``(window_s, max_gain, decode_token_cost)``. Notes the gain in ``info``."""
    window_s, max_gain, decode_token_cost = reuse
    n = len(inp.engine_names)
    if inp.engine_tokens is None or max_gain <= 1.0:
        return np.ones(n)
    history.append((inp.now_s, np.asarray(inp.engine_tokens, dtype=np.float64)))
    while len(history) > 2 and history[1][0] <= inp.now_s - window_s:
        history.popleft()
    if len(history) < 2:
        return np.ones(n)
    delta = history[-1][1] - history[0][1]
    delta[:, np.any(delta < 0, axis=0)] = np.nan  # a restarted engine: no evidence this window
    keys = list(
        zip(inp.engine_models, inp.capacity_rps, inp.idle_ttft_s, inp.idle_tbot_s, strict=True)
    )
    first = {k: i for i, k in reversed(list(enumerate(keys)))}
    group = np.array([first[k] for k in keys], dtype=np.intp)
    gain = group_reuse_gains(
        delta[0], delta[1], delta[2], group, max_gain=max_gain, decode_token_cost=decode_token_cost
    )
    info["reuse_gain"] = gain.tolist()
    return gain


def lp_optimiser(
    *,
    kappa_s: float | None = None,
    allow_shed: bool = True,
    derate: bool = False,
    derating: dict[str, Any] | None = None,
    demand_alpha: float = 0.3,
    peak_periods: int = 3,
    demand_deadband_z: float = 2.0,
    min_demand_rps: float = 0.01,
    max_reuse_gain: float | None = None,
    reuse_window_s: float = DEFAULT_WINDOW_S,
    reuse_decode_cost: float = DECODE_TOKEN_COST,
) -> Callable[[Any], Any]:
    """The routing LP as a simulator optimiser (see the module docstring for the tunables)."""
    if max_reuse_gain is None:
        max_reuse_gain = ControllerConfig().max_reuse_gain
    if kappa_s is None:
        kappa_s = ControllerConfig().kappa_s  # the service's default
    if kappa_s < 0 or min_demand_rps < 0:
        raise ValueError("kappa_s and min_demand_rps must be >= 0")
    derating_cfg = msgspec.convert(derating or {}, DeratingConfig)
    lp = RoutingLP(time_limit_s=10.0)
    state: dict[str, Any] = {
        "x": None,
        "groups": None,
        "demand": None,
        "forecaster": None,
        "tracker": None,
        "profiles": None,
        "tokens": deque(),
    }

    def optimise(inp: Any) -> Any:
        if state["profiles"] is None:
            state["profiles"] = _profiles(inp)
            state["forecaster"] = DemandForecaster(
                range(len(inp.class_labels)),
                inp.class_sources,
                period_s=inp.period_s,
                alpha=demand_alpha,
                peak_periods=peak_periods,
                deadband_z=demand_deadband_z,
            )
        profiles = state["profiles"]
        demand, live = _forecast(state["forecaster"], inp, min_demand_rps)
        health = np.ones(len(inp.engine_names))
        info: dict[str, Any] = {}
        if derate:
            health = _derated_health(state, inp, derating_cfg, info)
        reuse = (reuse_window_s, max_reuse_gain, reuse_decode_cost)
        capacity = inp.capacity_rps * _reuse_gain(state["tokens"], inp, reuse, info)
        # grouped as the service groups (controller.planner): identical engines are one LP
        # column and split its rate ∝ capacity, so a degenerate LP cannot starve one of them
        groups = group_engines(
            profiles, capacity, inp.eligible, inp.network_latency_s, health=health
        )
        problem = RoutingProblem.from_groups(demand, groups, kappa_s=kappa_s, allow_shed=allow_shed)
        # Anchor where the service anchors: at what the published table sends at the new
        # demand (so a pure change of demand level moves nothing).
        anchor = None
        if state["x"] is not None:
            x_prev = state["x"]
            if not np.array_equal(state["groups"].group_of_engine, groups.group_of_engine):
                x_prev = regroup_rates(x_prev, state["groups"], groups)
            anchor = table_anchor(x_prev, state["demand"], demand)
        try:
            res = lp.solve(problem, x_prev_rps=anchor)
        except SolveError as exc:
            # Keep the table in force, as the service does when a solve fails.
            info["error"] = str(exc)
            return SimTable(inp.weights, np.zeros(len(inp.class_labels)), info)
        state["x"], state["groups"], state["demand"] = res.x_rps, groups, demand
        fallback = groups.eligible * groups.capacity_rps
        group_weights, _ = class_weights(res.x_rps, res.shed_rps, demand, fallback=fallback)
        weights = engine_weights(group_weights, groups)
        # as the service: the LP's admitted rate out of the live (not the held) demand
        shed = shed_at_demand(res.x_rps, res.shed_rps, live)
        info.update(
            objective=float(res.objective),
            iterations=int(res.iterations),
            solve_time_s=float(res.solve_time_s),
        )
        return SimTable(weights, shed, info)

    return optimise


def p_controller_optimiser(
    *,
    gain: float = 0.5,
    ewma_alpha: float = 0.3,
    min_weight: float = 1e-3,
    signal: str = "e2e",
) -> Callable[[Any], Any]:
    """The proportional baseline as a simulator optimiser (see the module docstring)."""
    if signal not in ("e2e", "ttft", "tbot"):
        raise ValueError(f"signal must be 'e2e', 'ttft' or 'tbot', got {signal!r}")
    state: dict[str, Any] = {"pc": None, "last": None}

    def optimise(inp: Any) -> Any:
        names = list(inp.engine_names)
        if state["pc"] is None:
            share = np.asarray(inp.capacity_rps, dtype=np.float64)
            state["pc"] = ProportionalController(
                gain,
                ewma_alpha,
                0,
                min_weight,
                engines=names,
                initial_weights=dict(zip(names, (share / share.sum()).tolist(), strict=True)),
            )
            idle = inp.idle_ttft_s + inp.mean_output_tokens * inp.idle_tbot_s
            state["last"] = {
                "e2e": idle,
                "ttft": inp.idle_ttft_s.copy(),
                "tbot": inp.idle_tbot_s.copy(),
            }[signal]
        w = inp.window
        count, total = {
            "e2e": (w.e2e_count, w.e2e_sum_s),
            "ttft": (w.ttft_count, w.ttft_sum_s),
            "tbot": (w.tbot_count, w.tbot_sum_s),
        }[signal]
        lat = np.where(count > 0, total / np.maximum(count, 1), state["last"])
        lat = np.maximum(lat, 1e-6)
        state["last"] = lat
        pw = state["pc"].step(dict(zip(names, lat.tolist(), strict=True)), inp.now_s)
        vec = np.array([pw[n] for n in names])
        rows = inp.eligible * vec[None, :]
        s = rows.sum(axis=1, keepdims=True)
        weights = np.divide(rows, s, out=np.zeros_like(rows), where=s > 0)
        return SimTable(weights, np.zeros(len(inp.class_labels)), {})

    return optimise


#: Optimiser factories by name.
OPTIMISERS: dict[str, Callable[..., Callable[[Any], Any]]] = {
    "lp": lp_optimiser,
    "p-controller": p_controller_optimiser,
}


def make_optimiser(name: str, **params: Any) -> Callable[[Any], Any]:
    """Build optimiser ``name`` with its tunables.

    Raises
    ------
    ValueError
        Unknown name or tunable.
    """
    try:
        factory = OPTIMISERS[name]
    except KeyError:
        raise ValueError(f"unknown optimiser {name!r}; known: {', '.join(OPTIMISERS)}") from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise ValueError(f"optimiser {name!r}: {exc}") from None
