"""controller.planner: the LP and the p-controller behind one Planner interface, and the service
calling the one its options name."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import numpy as np
import pytest

from controller.health import HealthWindow
from controller.lp import RoutingProblem
from controller.model import FleetModel
from controller.options import MODES, ControllerOptions
from controller.planner import (
    LPPlanner,
    PControllerPlanner,
    PeriodInputs,
    PeriodPlan,
    Planner,
    PlanningError,
    make_planner,
    use_sifting,
)
from controller.service import ControllerService
from controller.solve import RoutingLP, SolveError
from fastroute.config import Config, decode_config
from fastroute.errors import TableValueError

MODEL = "demo-8b"


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30.0))


def config(table: str = "unused") -> Config:
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["{MODEL}"]\nregion = "east"\nhardware = "{hw}"\ncapacity_rps = {cap}\n\n'
        for i, (hw, cap) in enumerate((("h100", 10.0), ("a40", 4.0), ("a40", 4.0)))
    )
    return decode_config(
        engines
        + '[[network.regions]]\nname = "east"\n\n'
        + "[controller]\nperiod_s = 1.0\nsolve_time_limit_s = 0.5\n\n"
        + f'[proxy]\ncluster = "east"\ntable_name = "{table}"\n',
        source="test.toml",
    )


def inputs(model: FleetModel, demand_rps: float = 3.0) -> PeriodInputs:
    n_g, n_e = len(model.classes), len(model.engine_names)
    demand = np.full(n_g, demand_rps)
    return PeriodInputs(
        model=model,
        demand_rps=demand,
        live_demand_rps=demand.copy(),
        now_s=1_000.0,
        engine_flags=np.zeros(n_e, dtype=np.uint8),
        window=HealthWindow.empty(n_e),
        health=np.ones(n_e),
        measured=np.zeros(n_g, dtype=bool),
    )


class SpyPlanner:
    """Wraps a planner; records what the service asks of it (optionally failing ``plan``)."""

    def __init__(self, inner: Planner, fail: PlanningError | None = None) -> None:
        self.inner = inner
        self.mode = inner.mode
        self.fail = fail
        self.planned: list[PeriodInputs] = []
        self.accepted_plans: list[PeriodPlan] = []

    async def plan(self, inputs: PeriodInputs) -> PeriodPlan:
        self.planned.append(inputs)
        if self.fail is not None:
            raise self.fail
        return await self.inner.plan(inputs)

    def accepted(self, inputs: PeriodInputs, period: PeriodPlan) -> None:
        self.accepted_plans.append(period)
        self.inner.accepted(inputs, period)


@pytest.mark.parametrize("mode", MODES)
def test_both_planners_satisfy_the_interface(mode: str) -> None:
    """Each mode's planner is a Planner named by its mode, and plans valid rows: per class the
    weights sum to 1 over eligible engines, the shed fractions lie in [0, 1]."""
    model = FleetModel.from_config(config())
    planner = make_planner(model, config().controller, ControllerOptions(mode=mode))
    assert isinstance(planner, Planner) and planner.mode == mode
    period = run(planner.plan(inputs(model)))
    assert isinstance(period, PeriodPlan)
    np.testing.assert_allclose(period.weights.sum(axis=1), 1.0)
    assert np.all(period.weights[~model.eligible] == 0)
    assert np.all((period.shed_fraction >= 0) & (period.shed_fraction <= 1))
    assert period.x_rps.shape == period.weights.shape
    assert period.result.status == ("Optimal" if mode == "lp" else "p-controller")


def test_make_planner_builds_the_mode_named() -> None:
    """``lp`` is the LP planner, ``p-controller`` the baseline, with the options' gains."""
    model = FleetModel.from_config(config())
    ctl = config().controller
    assert isinstance(make_planner(model, ctl, ControllerOptions()), LPPlanner)
    base = make_planner(model, ctl, ControllerOptions(mode="p-controller", p_gain=0.3))
    assert isinstance(base, PControllerPlanner)
    gains = {c.gain for c in base.baseline.controllers if c is not None}
    assert gains == {0.3}
    with pytest.raises(ValueError, match="mode must be one of lp, p-controller"):
        ControllerOptions(mode="pid")  # type: ignore[arg-type]


def test_the_lp_planner_anchors_at_the_accepted_plan() -> None:
    """No anchor before a plan is accepted; after, the accepted allocation scaled to the demand."""
    model = FleetModel.from_config(config())
    planner = LPPlanner(model, config().controller)
    first = inputs(model)
    assert planner.anchor(model, first.demand_rps) is None
    period = run(planner.plan(first))
    assert planner.anchor(model, first.demand_rps) is None  # planned, not yet in force
    planner.accepted(first, period)
    anchor = planner.anchor(model, first.demand_rps * 2.0)
    assert anchor is not None
    np.testing.assert_allclose(anchor, period.result.x_rps * 2.0)
    again = run(planner.plan(first))  # anchored now: not the remembered solve's inputs
    assert not again.reused


def test_planning_errors_name_the_alert_and_the_status() -> None:
    """A solver failure counts under its status, invalid weights under ``invalid``."""
    error = SolveError("Infeasible", "no")
    solve = PlanningError.of(error)
    assert (solve.kind, solve.status, str(solve)) == ("solve_error", "Infeasible", str(error))
    bad = PlanningError.of(TableValueError("row 0 sums to 2"))
    assert (bad.kind, bad.status, str(bad)) == ("invalid_weights", "invalid", "row 0 sums to 2")


@pytest.mark.parametrize("mode", MODES)
def test_the_service_calls_the_configured_planner(shm_name: str, mode: str) -> None:
    """The service builds the planner its options name, asks it once per period with the
    current model and forecast, publishes what it returns and then tells it so."""

    async def main() -> None:
        svc = ControllerService(config(shm_name), ControllerOptions(mode=mode))
        assert svc.planner.mode == mode
        assert isinstance(svc.planner, LPPlanner if mode == "lp" else PControllerPlanner)
        spy = SpyPlanner(svc.planner)
        svc.planner = spy
        svc.open()
        try:
            assert await svc.step()
            assert len(spy.planned) == 1 and len(spy.accepted_plans) == 1
            asked = spy.planned[0]
            assert asked.model is svc.model
            np.testing.assert_array_equal(asked.demand_rps, svc.demand())
            assert svc.plan is not None and svc.plan.result is spy.accepted_plans[0].result
            assert svc.plan.weights is spy.accepted_plans[0].weights
            assert svc.plan_json()["mode"] == mode
        finally:
            svc.close()

    run(main())


def test_a_planning_error_keeps_the_last_table(shm_name: str) -> None:
    """When the planner has no plan, nothing is published or accepted; the alert is counted by
    the error's kind and its status counted as a solve."""

    async def main() -> None:
        svc = ControllerService(config(shm_name))
        svc.open()
        try:
            await svc.step()
            gen, plan = svc.generation, svc.plan
            spy = SpyPlanner(svc.planner, fail=PlanningError.of(SolveError("Infeasible", "x")))
            svc.planner = spy
            assert not await svc.step()
            assert len(spy.planned) == 1 and spy.accepted_plans == []
            assert svc.generation == gen and svc.plan is plan and svc.last_error is not None
            registry = svc.metrics.registry
            alerts = {"kind": "solve_error"}
            assert registry.get_sample_value("fastroute_controller_alerts_total", alerts) == 1
            status = {"status": "Infeasible"}
            assert registry.get_sample_value("fastroute_controller_solves_total", status) == 1
        finally:
            svc.close()

    run(main())


def test_sifting_only_when_classes_may_use_more_than_its_first_working_set() -> None:
    """Residency-bound classes (12 of 300 groups each) solve whole; wide classes sift."""
    n_classes, n_groups = 5000, 300
    narrow = np.zeros((n_classes, n_groups), dtype=bool)
    narrow[:, :12] = True
    assert not use_sifting(narrow)
    wide = np.ones((50, 500), dtype=bool)
    assert use_sifting(wide)
    assert not use_sifting(np.ones((10, 100), dtype=bool))  # below SIFTING_MIN_PAIRS


def test_the_lp_planner_solves_priorities_as_one_class_and_sheds_lowest_first() -> None:
    """One region × one model: its three priority classes are one LP class (one shed column
    each). Over capacity (30 req/s on 18) the plan sheds batch first, as the class LP does, with
    the same objective and shed rates."""
    model = FleetModel.from_config(config())
    planner = LPPlanner(model, config().controller)
    period = run(planner.plan(inputs(model, demand_rps=10.0)))
    assert planner.lp.classes is not None and planner.lp.classes.n_groups == 1
    assert [c.priority for c in model.classes] == ["batch", "default", "interactive"]
    res = period.result
    # the class LP, built as the planner builds it (controller.planner._solve_period)
    g = model.groups
    slopes_max = max(float(p.slopes_s.max()) for p in g.profiles)
    d_max = float(g.network_latency_s[g.eligible].max(initial=0.0))
    ctl = config().controller
    base = ctl.shed_base_factor * max(slopes_max + d_max + 2.0 * ctl.kappa_s, 1e-3)
    problem = RoutingProblem.from_groups(
        np.full(3, 10.0), g, shed_weight=model.shed_weight, kappa_s=ctl.kappa_s,
        shed_penalty_base_s=base,
    )  # fmt: skip
    full = RoutingLP().solve(problem)
    assert abs(full.objective - res.objective) <= 1e-6 * abs(res.objective)
    np.testing.assert_allclose(res.shed_rps, full.shed_rps, atol=1e-6)
    assert res.shed_rps[0] > 9.0 and res.shed_rps[2] < 1e-9  # batch shed (nearly) in full
    np.testing.assert_allclose(period.shed_fraction, res.shed_rps / 10.0, atol=1e-9)
