"""Why each engine gets the share it gets: one line per engine, from the LP's duals and bounds.

The routing LP (:mod:`controller.lp`) gives every class ``g`` a dual ``μ_g`` on its demand row
(:attr:`controller.model.Plan.marginal_cost_s`): the latency one more request of ``g`` costs at
the optimum. An engine ``e`` whose first request would cost class ``g`` more than that —
``d_ge + κ + m_e1 > μ_g`` (network latency, move penalty, the first PWL segment's slope) — gets
none of ``g``. The line says, in this order of precedence:

* ``unavailable`` / ``no capacity``: the health level is 0 or the capacity is 0;
* ``derated``: the controller cut its capacity; the derating reason (e.g. TTFT against its
  profile) is quoted; the load follows;
* ``saturated``: its utilisation reached the last breakpoint ``ρ_max`` — the capacity bound is
  binding, more demand for it goes elsewhere or is shed;
* ``held in reserve``: it carries (almost) nothing because serving its nearest class (with
  demand; the busiest among equals) from the
  engine that does serve it is cheaper (``entry > μ_g``); the line names that engine and the
  utilisation at which it stops being cheaper (the first breakpoint from which ``d_ge' + m_e'k``
  exceeds ``e``'s entry cost). When ``entry ≤ μ_g`` the next request would come here and the
  move penalty ``κ`` is what keeps the present traffic where it is (``held back``);
* ``idle``: no class with demand may use it;
* otherwise ``balanced``: its marginal latency equals its classes' ``μ`` at its utilisation.

Plans of the ``p-controller`` baseline have no duals and say so. All of it is computed on the
LP's engine groups (engines of one group share its utilisation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from controller.model import FleetModel, Plan

__all__ = ["IDLE_SHARE", "PlanContext", "explain_engines"]

FloatArray = npt.NDArray[np.float64]

#: An engine carrying less than this fraction of its effective capacity counts as idle: the
#: demo's "0–1 %" engines. Below 1 % the engine's latency is its idle latency within the
#: profile's resolution (the first segment spans ρ 0 → 0.30), so nothing is lost calling it idle.
IDLE_SHARE = 0.01
#: Utilisation within this of ``ρ_max`` is saturated (HiGHS's primal feasibility tolerance is
#: 1e-7 of the demand; 1e-3 covers the grouped split's rounding too).
SATURATION_TOL = 1e-3


@dataclass(frozen=True, eq=False)
class PlanContext:
    """What the explanation reads.

    Attributes
    ----------
    model : FleetModel
        The fleet model the plan was solved on (groups, profiles, network latency).
    plan : Plan
        The plan in force.
    derating : sequence of mapping
        Per engine ``{"level": h, "reason": str}`` (:meth:`controller.health` state).
    kappa_s : float
        The LP's move penalty ``κ`` (``controller.kappa_s``).
    """

    model: FleetModel
    plan: Plan
    derating: Sequence[Mapping[str, Any]]
    kappa_s: float = 0.0


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %"


def _dur(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1.0 else f"{seconds:.1f} s"


def _default_demand_note(ctx: PlanContext, engine: int) -> str:
    """A note when every class routed to ``engine`` is planned for its capacity default."""
    plan = ctx.plan
    routed = plan.x_rps[:, engine] > 0
    if routed.any() and not plan.measured[routed].any():
        return "; planned for the default demand (no reports yet)"
    return ""


def _group_utilisation(ctx: PlanContext) -> FloatArray:
    g = ctx.model.groups
    load = ctx.plan.result.x_rps.sum(axis=0)
    return np.divide(load, g.capacity_rps, out=np.zeros_like(load), where=g.capacity_rps > 0)


def _entry_cost_s(ctx: PlanContext, cls: int, group: int) -> float:
    """What class ``cls``'s first request on ``group`` costs (s): ``d + κ + m_1``."""
    g = ctx.model.groups
    return float(g.network_latency_s[cls, group] + ctx.kappa_s + g.profiles[group].slopes_s[0])


def _cheaper_until(ctx: PlanContext, cls: int, rival: int, entry_s: float) -> float | None:
    """Utilisation of ``rival`` from which its next request costs ``cls`` more than ``entry_s``
    (None: never before ``ρ_max``)."""
    g = ctx.model.groups
    prof = g.profiles[rival]
    marginal = g.network_latency_s[cls, rival] + prof.slopes_s
    above = np.flatnonzero(marginal > entry_s)
    return None if above.size == 0 else float(prof.breakpoints_rho[above[0]])


def _reserve_line(ctx: PlanContext, engine: int, util: FloatArray) -> str:
    """Why an engine with (almost) no load gets none: its busiest eligible class's view."""
    m, plan = ctx.model, ctx.plan
    group = int(m.groups.group_of_engine[engine])
    classes = np.flatnonzero(m.groups.eligible[:, group] & (plan.demand_rps > 0))
    if classes.size == 0:
        return f"idle: no demand for {', '.join(_models(m, engine)) or 'its models'}"
    # the nearest class first (the engine's own region: "why does my region not use it?"),
    # then the busiest
    d = m.groups.network_latency_s[classes, group]
    cls = int(classes[np.lexsort((-plan.demand_rps[classes], d))[0]])
    spec = m.classes[cls]
    x_cls = plan.result.x_rps[cls]
    if x_cls.sum() <= 0:
        return f"idle: {spec.name} is shed entirely (its penalty is below any engine's cost)"
    rival = int(np.argmax(x_cls))
    rival_name = _group_label(m, rival)
    entry_s = _entry_cost_s(ctx, cls, group)
    mu_s = float(plan.marginal_cost_s[cls])
    if entry_s <= mu_s + 1e-9:
        # the next request of the class would come here; what it carries now stays put
        if ctx.kappa_s > 0:
            return (
                f"held back by the move penalty κ = {ctx.kappa_s * 1e3:.0f} ms: moving "
                f"{spec.cluster}'s traffic here from {rival_name} gains less than it costs"
            )
        return f"tied with {rival_name} for {spec.cluster} at the margin; the LP left it empty"
    until = _cheaper_until(ctx, cls, rival, entry_s)
    where = (
        "until they saturate" if until is None else f"until they reach {_pct(until)} utilisation"
    )
    return (
        f"held in reserve: cheaper to serve {spec.cluster} from {rival_name} {where} "
        f"(now {_pct(float(util[rival]))}; a request costs {_dur(entry_s)} here, "
        f"{_dur(mu_s)} there at the margin)"
    )


def _models(m: FleetModel, engine: int) -> list[str]:
    return sorted({c.model for c, ok in zip(m.classes, m.eligible[:, engine], strict=True) if ok})


def _group_label(m: FleetModel, group: int) -> str:
    members = m.groups.members[group]
    names = [m.engine_names[int(i)] for i in members]
    return names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} alike)"


def _engine_line(ctx: PlanContext, engine: int, util: FloatArray) -> str:
    m, plan = ctx.model, ctx.plan
    group = int(m.groups.group_of_engine[engine])
    level = float(ctx.derating[engine].get("level", 1.0))
    reason = str(ctx.derating[engine].get("reason") or "anomalous")
    cap = float(m.groups.engine_capacity_rps[engine])
    rho = float(util[group])
    rho_max = float(m.groups.profiles[group].breakpoints_rho[-1])
    if level <= 0.0:
        return f"unavailable: derated to 0 ({reason})"
    if cap <= 0.0:
        return "no capacity: capacity_rps is 0"
    note = _default_demand_note(ctx, engine)
    # utilisation of a small engine is a small share of the fleet: say the rates too
    rates = f" ({float(plan.x_rps[:, engine].sum()):.2g} of {cap:.2g} rps)"
    if level < 1.0:
        return f"derated to {_pct(level)} of its capacity ({reason}); at {_pct(rho)} utilisation"
    if rho >= rho_max - SATURATION_TOL:
        return f"saturated: at ρ_max = {_pct(rho_max)}{rates} (capacity bound binding){note}"
    if float(plan.x_rps[:, engine].sum()) < IDLE_SHARE * cap:
        return _reserve_line(ctx, engine, util)
    return (
        f"balanced: at {_pct(rho)} utilisation{rates} its marginal latency equals its "
        f"classes'{note}"
    )


def explain_engines(ctx: PlanContext) -> list[str]:
    """One line per engine of ``ctx.model`` (config order): why its share is what it is."""
    if ctx.plan.result.status == "p-controller":
        return ["p-controller mode: weights follow measured latencies, no LP to explain"] * len(
            ctx.model.engine_names
        )
    n_engines = len(ctx.model.engine_names)
    shape = (len(ctx.model.classes), n_engines)
    if ctx.plan.result.x_rps.shape[1] != ctx.model.groups.n_groups or ctx.plan.x_rps.shape != shape:
        # learning regrouped the engines, or engines joined, after this plan was solved
        return ["the fleet changed since this plan: explained at the next period"] * n_engines
    util = _group_utilisation(ctx)
    return [_engine_line(ctx, i, util) for i in range(n_engines)]
