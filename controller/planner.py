"""Period planning behind one interface: the routing LP or the proportional baseline.

A :class:`Planner` turns one period's :class:`PeriodInputs` (the fleet model as learnt so far, the
demand forecast, the engine flags, the last signal window) into a :class:`PeriodPlan`: validated
engine weights per class, shed fractions, the allocation and a :class:`SolveResult` to explain it.
The service publishes the plan and tells the planner (:meth:`Planner.accepted`), so a planner can
anchor its next period at what is in force.

* :class:`LPPlanner` (``mode = "lp"``): :class:`controller.solve.RoutingLP` (or
  :class:`controller.sifting.SiftingLP` on big LPs) over class aggregates
  (:class:`controller.class_groups.AggregatedLP`: classes alike but for their priority solved
  as one, each keeping its shed column)
  in a worker thread, warm, anchored at what the
  published table sends at the new forecast (:func:`controller.weights.table_anchor`); a period
  whose LP inputs equal the last successful solve's reuses its result
  (:class:`controller.memo.SolveMemo`). Shed fractions are taken at the demand *level*
  (:meth:`controller.demand.DemandForecaster.level`, the EWMA;
  :func:`controller.weights.shed_at_demand`; the LP planned for the held forecast).
* :class:`PControllerPlanner` (``mode = "p-controller"``): the legacy proportional controller
  (:class:`controller.baseline.BaselinePolicy`) on the window's latencies; never sheds.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from controller.baseline import BaselinePolicy, window_latency_s
from controller.class_groups import AggregatedLP
from controller.groups import EngineGroups, regroup_rates
from controller.health import HealthWindow
from controller.lp import RoutingProblem
from controller.memo import SolveInputs, SolveMemo
from controller.model import FleetModel
from controller.options import ControllerOptions
from controller.sifting import SiftingLP
from controller.solve import RoutingLP, SolveError, SolveResult
from controller.weights import (
    class_weights,
    engine_weights,
    shed_at_demand,
    table_anchor,
    validate_weights,
)
from fastroute.config import ControllerConfig
from fastroute.errors import TableError
from fastroute.tables import FLAG_UNAVAILABLE

__all__ = [
    "AGGREGATE_ACROSS_PRIORITIES",
    "SIFTING_MIN_PAIRS",
    "LPPlanner",
    "PControllerPlanner",
    "PeriodInputs",
    "PeriodPlan",
    "PeriodSolution",
    "Planner",
    "PlanningError",
    "make_planner",
    "use_sifting",
]

FloatArray = npt.NDArray[np.float64]

#: Grouped LPs with at least this many eligible (class, group) pairs are solved by column
#: generation (:class:`controller.sifting.SiftingLP`) — if a class has more eligible groups
#: than sifting's first working set takes (:func:`use_sifting`).
SIFTING_MIN_PAIRS = 10_000

#: Aggregate classes that differ only in priority too, each keeping its own shed column
#: (:class:`controller.class_groups.AggregatedLP`): exact while shed fractions hold, the move
#: charge bounded when they change; 5 000 → 400 LP classes in a cluster × model × priority fleet
#: (docs/controller.md "Plan at scale").
AGGREGATE_ACROSS_PRIORITIES = True

#: One period's solve: the LP result, engine weights, shed fractions, per-engine allocation.
PeriodSolution = tuple[SolveResult, FloatArray, FloatArray, FloatArray]


def use_sifting(eligible: npt.NDArray[np.bool_]) -> bool:
    """Whether column generation pays off on a grouped LP of this eligibility.

    It does on big LPs where a class may use many groups: the first working set holds each class's
    ``max(16, n_groups // 8)`` cheapest pairs and most others never enter. When classes may use
    fewer groups than that on average (residency-bound classes, e.g. 100 regions × 3 hardware
    groups with a class confined to 4 regions: 12 of 300), the first working set is the whole LP
    and sifting only adds a pricing pass per period (side by side in CPU time at 100 × 10 000 × 50:
    warm periods 1.19–1.26 s sifted vs 1.13–1.27 s whole, docs/controller.md "Plan at scale").
    """
    pairs = int(np.count_nonzero(eligible))
    n_classes, n_groups = eligible.shape
    first_set_per_class = max(16, n_groups // 8)
    return pairs >= SIFTING_MIN_PAIRS and pairs > first_set_per_class * n_classes


def _solve_period(
    lp: AggregatedLP,
    model: FleetModel,
    demand_rps: FloatArray,
    x_prev_rps: FloatArray | None,
    kappa_s: float,
    shed_base_factor: float,
) -> PeriodSolution:
    """Build, solve and turn into validated engine rows (runs in a worker thread)."""
    g = model.groups
    elig = g.eligible
    slopes_max = max(float(p.slopes_s.max()) for p in g.profiles)
    d_max = float(g.network_latency_s[elig].max(initial=0.0))
    p0 = shed_base_factor * max(slopes_max + d_max + 2.0 * kappa_s, 1e-3)
    problem = RoutingProblem.from_groups(
        demand_rps, g, shed_weight=model.shed_weight, kappa_s=kappa_s, shed_penalty_base_s=p0
    )
    res = lp.solve(problem, x_prev_rps)
    fallback = elig * g.capacity_rps
    wg, sigma = class_weights(res.x_rps, res.shed_rps, demand_rps, fallback=fallback)
    w = engine_weights(wg, g)
    validate_weights(w, sigma)
    return res, w, sigma, g.split(res.x_rps)


@dataclass(frozen=True, eq=False)
class PeriodInputs:
    """What a planner plans one period from.

    Attributes
    ----------
    model : FleetModel
        The fleet as learnt so far (profiles, health-derated groups).
    demand_rps : ndarray, shape (n_classes,)
        The held forecast (what the LP plans for).
    live_demand_rps : ndarray, shape (n_classes,)
        The demand level, the EWMA (what shed fractions must admit out of).
    now_s : float
        Controller clock, Unix seconds.
    engine_flags : ndarray of uint8, shape (n_engines,)
        ``FLAG_*`` bits to publish (``FLAG_UNAVAILABLE``: derated to 0).
    window : HealthWindow or None
        The last closed signal window (None before the first).
    health : ndarray, shape (n_engines,)
        Health factors ``h`` (already in ``model.groups``; kept for the explain page).
    measured : ndarray of bool, shape (n_classes,)
        Whose demand came from reports (else the capacity default).
    """

    model: FleetModel
    demand_rps: FloatArray
    live_demand_rps: FloatArray
    now_s: float
    engine_flags: npt.NDArray[np.uint8]
    window: HealthWindow | None
    health: FloatArray
    measured: npt.NDArray[np.bool_]


@dataclass(frozen=True, eq=False)
class PeriodPlan:
    """One period's plan, ready to publish.

    Attributes
    ----------
    result : SolveResult
        The solve (or the baseline's stand-in with status ``"p-controller"``).
    weights : ndarray, shape (n_classes, n_engines)
        Validated table rows.
    shed_fraction : ndarray, shape (n_classes,)
    x_rps : ndarray, shape (n_classes, n_engines)
        Allocation per engine (req/s).
    reused : bool
        The result is the last solve's (same LP inputs): nothing was solved this period.
    """

    result: SolveResult
    weights: FloatArray
    shed_fraction: FloatArray
    x_rps: FloatArray
    reused: bool = False


class PlanningError(Exception):
    """No plan this period (the last good table stays published).

    Attributes
    ----------
    kind : str
        Alert kind: ``"solve_error"`` (the solver failed) or ``"invalid_weights"``.
    status : str
        Solve status to count it under (the solver's, or ``"invalid"``).
    """

    def __init__(self, kind: str, status: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status

    @classmethod
    def of(cls, exc: SolveError | TableError | ValueError) -> PlanningError:
        """The planning error for a solver failure or invalid weights."""
        if isinstance(exc, SolveError):
            return cls("solve_error", exc.status, str(exc))
        return cls("invalid_weights", "invalid", str(exc))


@runtime_checkable
class Planner(Protocol):
    """Plans one period at a time (see the module docstring)."""

    #: The control policy's name (:data:`controller.options.MODES`).
    mode: str

    async def plan(self, inputs: PeriodInputs) -> PeriodPlan:
        """Plan one period; raises :class:`PlanningError` when there is no plan to publish."""
        ...

    def accepted(self, inputs: PeriodInputs, period: PeriodPlan) -> None:
        """``period`` (planned from ``inputs``) is now the plan in force."""
        ...


class LPPlanner:
    """The routing LP as the period planner (see the module docstring).

    Parameters
    ----------
    model : FleetModel
        Sizes the LP (column generation from :data:`SIFTING_MIN_PAIRS` eligible pairs).
    controller : ControllerConfig
        ``solve_time_limit_s``, ``kappa_s``, ``shed_base_factor``.
    """

    mode = "lp"

    def __init__(self, model: FleetModel, controller: ControllerConfig) -> None:
        limit_s = controller.solve_time_limit_s
        # the LP is solved over class aggregates (exact: controller.class_groups); column
        # generation pays off only on big LPs (ungroupable fleets), tens of groups solve in
        # milliseconds as they are
        rows = RoutingProblem.from_groups(
            model.default_rps,
            model.groups,
            shed_weight=model.shed_weight,
            kappa_s=controller.kappa_s,
        )
        self.lp = AggregatedLP(
            RoutingLP(time_limit_s=limit_s), across_priorities=AGGREGATE_ACROSS_PRIORITIES
        )
        # the partition is cached in the wrapper, so the first period does not hash it again
        reps = self.lp.partition(rows).representative
        if use_sifting(model.groups.eligible[reps]):
            self.lp.inner = SiftingLP(time_limit_s=limit_s)
        self.kappa_s = controller.kappa_s
        self.shed_base_factor = controller.shed_base_factor
        #: The last successful LP solve, reused while a period's LP inputs are the same.
        self.memo: SolveMemo[PeriodSolution] = SolveMemo()
        self._x_prev: FloatArray | None = None
        self._demand_prev: FloatArray | None = None
        self._groups_prev: EngineGroups | None = None

    def anchor(self, model: FleetModel, demand_rps: FloatArray) -> FloatArray | None:
        """What the plan in force sends at ``demand_rps``, on ``model``'s groups (None: no plan)."""
        if self._x_prev is None or self._demand_prev is None:
            return None
        x_prev = self._x_prev
        old, new = self._groups_prev, model.groups
        if old is not None and not np.array_equal(old.group_of_engine, new.group_of_engine):
            x_prev = regroup_rates(x_prev, old, new)
        return table_anchor(x_prev, self._demand_prev, demand_rps)

    async def plan(self, inputs: PeriodInputs) -> PeriodPlan:
        """Solve (or reuse) the period's LP; shed fractions at the demand level."""
        demand = inputs.demand_rps
        anchor = self.anchor(inputs.model, demand)
        kappa_s, p0_factor = self.kappa_s, self.shed_base_factor
        key = SolveInputs(self.lp, inputs.model, demand, anchor, kappa_s, p0_factor)
        try:
            solution = self.memo.get(key)
            reused = solution is not None
            if solution is None:
                solution = await asyncio.to_thread(
                    _solve_period,
                    self.lp,
                    inputs.model,
                    demand,
                    anchor,
                    kappa_s,
                    p0_factor,
                )
                self.memo.put(key, solution)
        except (SolveError, TableError, ValueError) as exc:
            self.memo.forget()
            raise PlanningError.of(exc) from exc
        res, w, _, x_eng = solution
        # the LP planned for the held forecast; a shed class's fraction must admit its routed
        # rate out of the demand level (controller.weights.shed_at_demand)
        sigma = shed_at_demand(res.x_rps, res.shed_rps, inputs.live_demand_rps)
        return PeriodPlan(res, w, sigma, x_eng, reused=reused)

    def accepted(self, inputs: PeriodInputs, period: PeriodPlan) -> None:
        """Anchor the next period at ``period``'s allocation."""
        self._x_prev = period.result.x_rps
        self._demand_prev = inputs.demand_rps
        self._groups_prev = inputs.model.groups


class PControllerPlanner:
    """The legacy proportional controller as the period planner (``--mode p-controller``).

    Parameters
    ----------
    model : FleetModel
        Eligibility and engine names of the baseline's rows.
    gain, ewma_alpha : float
        The baseline's gain ``K`` and EWMA factor (:class:`controller.baseline.BaselinePolicy`).
    """

    mode = "p-controller"

    def __init__(self, model: FleetModel, *, gain: float, ewma_alpha: float) -> None:
        self.baseline = BaselinePolicy(
            model.eligible, model.engine_names, gain=gain, ewma_alpha=ewma_alpha
        )

    async def plan(self, inputs: PeriodInputs) -> PeriodPlan:
        """Nudge the weights by the last window's latencies (in a worker thread)."""
        try:
            res, w, sigma, x = await asyncio.to_thread(self._baseline_period, inputs)
        except (SolveError, TableError, ValueError) as exc:
            raise PlanningError.of(exc) from exc
        return PeriodPlan(res, w, sigma, x)

    def accepted(self, inputs: PeriodInputs, period: PeriodPlan) -> None:
        """Nothing: the baseline keeps its own weights."""

    def _baseline_period(self, inputs: PeriodInputs) -> PeriodSolution:
        """One ``p-controller`` period: nudge the weights by the window's latencies."""
        t0 = time.perf_counter()
        model, demand, flags = inputs.model, inputs.demand_rps, inputs.engine_flags
        window = inputs.window or HealthWindow.empty(len(model.engine_names))
        latency = window_latency_s(window, model.profiles)
        w = self.baseline.step(latency, inputs.now_s, available=(flags & FLAG_UNAVAILABLE) == 0)
        sigma = np.zeros(w.shape[0])
        validate_weights(w, sigma)
        x = w * demand[:, None]
        res = SolveResult(
            x_rps=x,
            shed_rps=sigma.copy(),
            objective=0.0,
            marginal_cost_s=np.zeros(w.shape[0]),
            load_rps=x.sum(axis=0),
            status="p-controller",
            iterations=0,
            solve_time_s=time.perf_counter() - t0,
            build_time_s=0.0,
            warm=False,
        )
        return res, w, sigma, x


def make_planner(
    model: FleetModel, controller: ControllerConfig, options: ControllerOptions
) -> Planner:
    """The planner ``options.mode`` names, for ``model``."""
    if options.mode == "p-controller":
        return PControllerPlanner(model, gain=options.p_gain, ewma_alpha=options.p_ewma_alpha)
    return LPPlanner(model, controller)
