"""controller.why on small LPs whose binding constraints are known: every claim a line makes is
checked against the LP itself (a reserve engine's threshold by re-solving on both sides of it)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from controller.lp import RoutingProblem
from controller.model import FleetModel, Plan
from controller.solve import RoutingLP, SolveResult
from controller.why import PlanContext, explain_engines
from fastroute.config import decode_config

MODEL = "demo-8b"
HEALTHY = {"level": 1.0, "reason": "healthy"}


def _model(
    regions: tuple[str, ...] = ("east", "west"), cap_rps: float = 10.0, hardware: str = "h100"
) -> FleetModel:
    """engine-0 in east, engine-1 in west (``cap_rps`` each; H100, or ``hardware`` for all but
    engine-0), east ↔ west 80 ms."""
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["{MODEL}"]\nregion = "{r}"\nhardware = "{"h100" if i == 0 else hardware}"\n'
        f"capacity_rps = {cap_rps}\n\n"
        for i, r in enumerate(regions)
    )
    nets = "".join(f'[[network.regions]]\nname = "{r}"\n\n' for r in sorted(set(regions)))
    rtt = "[network.rtt_ms]\neast = { west = 80.0 }\n\n" if len(set(regions)) > 1 else ""
    toml = (
        engines
        + nets
        + rtt
        + "[controller]\nperiod_s = 1.0\nsolve_time_limit_s = 0.5\n\n"
        + '[proxy]\ncluster = "east"\ntable_name = "unused"\n'
    )
    return FleetModel.from_config(decode_config(toml, source="why.toml"))


def _demand(model: FleetModel, **by_cluster: float) -> np.ndarray:
    """Demand on each cluster's default-priority class only."""
    return np.array(
        [by_cluster.get(c.cluster, 0.0) if c.priority == "default" else 0.0 for c in model.classes]
    )


def _plan(model: FleetModel, demand: np.ndarray) -> Plan:
    problem = RoutingProblem.from_groups(demand, model.groups, shed_weight=model.shed_weight)
    res = RoutingLP().solve(problem)
    return _wrap(model, demand, res)


def _wrap(model: FleetModel, demand: np.ndarray, res: SolveResult) -> Plan:
    x = model.groups.split(res.x_rps)
    shed = np.divide(res.shed_rps, demand, out=np.zeros_like(demand), where=demand > 0)
    return Plan(1, 1, 0.0, demand, np.ones(demand.size, bool), x, x, shed,
                res.marginal_cost_s, 0.1, res)  # fmt: skip


def _why(model: FleetModel, plan: Plan, derating: list[dict] | None = None) -> list[str]:
    ctx = PlanContext(model, plan, derating or [HEALTHY] * len(model.engine_names))
    return explain_engines(ctx)


def test_remote_engine_is_held_in_reserve_until_the_threshold_it_names() -> None:
    """East demand at 10 % of engine-0: engine-1 (80 ms away) carries nothing, and the line
    names the utilisation of engine-0 from which the LP starts using it; re-solving just below
    and just above that utilisation shows the LP does exactly that."""
    m = _model()
    cap = float(m.capacity_rps[0])
    plan = _plan(m, _demand(m, east=0.1 * cap))
    near, far = _why(m, plan)
    assert near.startswith("balanced: at 10 % utilisation (1 of 10 rps)"), near
    assert far.startswith("held in reserve: cheaper to serve east from engine-0 until they reach")
    until = float(re.search(r"until they reach (\d+) % utilisation", far).group(1)) / 100
    assert "(now 10 %" in far
    assert until in m.profiles[0].breakpoints_rho
    # the claim, checked on the LP: below the threshold engine-1 stays empty, above it not
    below = _plan(m, _demand(m, east=(until - 0.02) * cap))
    above = _plan(m, _demand(m, east=(until + 0.05) * cap))
    assert below.x_rps[:, 1].sum() == pytest.approx(0.0, abs=1e-9)
    assert below.x_rps[:, 0].sum() == pytest.approx((until - 0.02) * cap)
    assert above.x_rps[:, 1].sum() > 1e-6
    assert _why(m, below)[1].startswith("held in reserve")


def test_a_slow_local_engine_names_its_own_region_served_from_the_faster_remote_one() -> None:
    """West's A40 idles while west's demand goes 80 ms east to the much faster H100: the line is
    about west (its own region), though east's demand is larger."""
    m = _model(hardware="a40")
    plan = _plan(m, _demand(m, east=2.0, west=1.0))
    assert plan.x_rps[:, 1].sum() == pytest.approx(0.0, abs=1e-9)
    line = _why(m, plan)[1]
    assert line.startswith("held in reserve: cheaper to serve west from engine-0 until they")


def test_saturated_engines_name_the_binding_capacity_bound() -> None:
    """Demand three times the fleet: both engines fill to ρ_max and the rest is shed."""
    m = _model()
    plan = _plan(m, _demand(m, east=60.0))
    assert plan.shed_fraction.max() > 0.5
    rho_max = float(m.profiles[0].breakpoints_rho[-1])
    for line in _why(m, plan):
        assert line == (
            f"saturated: at ρ_max = {rho_max * 100:.0f} % (9.5 of 10 rps) (capacity bound binding)"
        )


def test_derated_and_unavailable_engines_quote_the_derating_reason() -> None:
    m = _model(("east", "east"))
    plan = _plan(m, _demand(m, east=5.0))
    reason = "TTFT 3.1× its profile, for 3 windows"
    lines = _why(m, plan, [{"level": 0.5, "reason": reason}, {"level": 0.0, "reason": "down"}])
    assert lines[0].startswith("derated to 50 % of its capacity (TTFT 3.1× its profile")
    assert lines[1] == "unavailable: derated to 0 (down)"


def test_plans_for_unmeasured_demand_say_so() -> None:
    m = _model(("east", "east"))
    plan = _plan(m, _demand(m, east=6.0))
    unmeasured = Plan(**{**plan.__dict__, "measured": np.zeros(len(m.classes), bool)})
    assert all(w.endswith("; planned for the default demand (no reports yet)")
               for w in _why(m, unmeasured))  # fmt: skip
    assert not any("default demand" in w for w in _why(m, plan))


def test_engines_without_demand_are_idle() -> None:
    m = _model()
    plan = _plan(m, _demand(m))
    assert _why(m, plan) == [f"idle: no demand for {MODEL}"] * 2


def test_two_alike_engines_share_one_group_and_one_explanation() -> None:
    """Two east engines form one LP group: both at the group's utilisation, balanced."""
    m = _model(("east", "east"))
    assert m.groups.n_groups == 1
    plan = _plan(m, _demand(m, east=6.0))
    assert _why(m, plan) == ["balanced: at 30 % utilisation (3 of 10 rps) its marginal latency "
                             "equals its classes'"] * 2  # fmt: skip


def test_move_penalty_holds_back_traffic_the_lp_would_otherwise_move() -> None:
    """Anchored on engine-0 above the threshold, a large κ keeps engine-1 empty: the line blames κ,
    and without κ the same LP moves traffic there."""
    m = _model()
    cap = float(m.capacity_rps[0])
    demand = _demand(m, east=0.8 * cap)
    anchor = np.zeros((len(m.classes), m.groups.n_groups))
    anchor[:, 0] = demand
    kappa_s = 5.0
    kw = {"shed_weight": m.shed_weight, "shed_penalty_base_s": 100.0}
    held = RoutingLP().solve(
        RoutingProblem.from_groups(demand, m.groups, kappa_s=kappa_s, **kw), anchor
    )
    free = RoutingLP().solve(RoutingProblem.from_groups(demand, m.groups, **kw), anchor)
    assert held.x_rps[:, 1].sum() == pytest.approx(0.0, abs=1e-9)
    assert free.x_rps[:, 1].sum() > 1e-6
    ctx = PlanContext(m, _wrap(m, demand, held), [HEALTHY] * 2, kappa_s=kappa_s)
    assert explain_engines(ctx)[1].startswith("held back by the move penalty κ = 5000 ms")


def test_p_controller_plans_and_changed_fleets_say_so() -> None:
    m = _model()
    plan = _plan(m, _demand(m, east=2.0))
    res = plan.result
    baseline = SolveResult(res.x_rps, res.shed_rps, 0.0, res.marginal_cost_s, res.load_rps,
                           "p-controller", 0, 0.0, 0.0, False)  # fmt: skip
    assert _why(m, _wrap(m, plan.demand_rps, baseline))[0].startswith("p-controller mode")
    other = _model(("east", "west", "west"))
    assert _why(other, plan, [HEALTHY] * 3)[0].startswith("the fleet changed since this plan")
