"""From LP rates to published weight rows, shed fractions, and the churn metric.

Per class ``g`` (docs/algorithms.md §1.3): the weight row is ``w_ge = x_ge / Σ_e x_ge``
(which is ``x_ge / (D_g − shed_g)`` at an optimum; dividing by the row sum makes rows sum to 1
exactly), the shed fraction is ``σ_g = shed_g / D_g``. A fully shed class, or a class with no
allocation, gets an all-zero row (unless a fallback row is given). Group weights are split over
members ∝ effective capacity (exact aggregation, :mod:`controller.groups`).

Anchor (:func:`table_anchor`): the LP's move penalty ``κ‖x − x⁰‖₁`` should price the traffic that
changes destination relative to the table *in force*. At a new demand ``D'`` the published rows
send ``(1 − σ_g) w_ge D'_g = x_ge · D'_g / D_g`` to each target, so that, not the previous rates
``x``, is the anchor: a class whose demand merely scales keeps its weights for free, and only the
increment (or decrement) that must land elsewhere pays κ. Anchoring at the old rates instead
charges κ for keeping the weights and makes the LP put the whole increment on one marginal target,
which is weight churn (reference §8.3; measured in bench/test_bench_lp.py).

Shed at the live demand (:func:`shed_at_demand`): the LP plans for the forecast the
:class:`controller.demand.DemandForecaster` *holds* inside its noise dead band, which may be up to
two standard errors off the latest estimate. Weights are fractions and barely depend on the level,
but a shed fraction does: a class the LP sheds is admitted at ``Σ_e x_ge`` req/s, and the fraction
that admits that rate out of the live demand ``D̂_g`` is ``1 − Σ_e x_ge / D̂_g``.

Churn (reference §8.3): ``TV_t = ½ Σ_g D_g Σ_e |w_ge,t − w_ge,t−1| / Σ_g D_g``, the fraction
of traffic whose destination changed between two periods; HRW moves about twice that many
session keys.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from controller.groups import EngineGroups
from fastroute.errors import TableValueError
from fastroute.tables import check_weights

__all__ = [
    "class_weights",
    "churn",
    "engine_weights",
    "region_engine_weights",
    "shed_at_demand",
    "table_anchor",
    "validate_weights",
]

FloatArray = npt.NDArray[np.float64]


def class_weights(
    x_rps: npt.ArrayLike,
    shed_rps: npt.ArrayLike,
    demand_rps: npt.ArrayLike,
    *,
    fallback: npt.ArrayLike | None = None,
    min_rate_rps: float = 1e-9,
) -> tuple[FloatArray, FloatArray]:
    """Normalised weight rows and shed fractions from an LP solution.

    Parameters
    ----------
    x_rps : array_like, shape (n_classes, n_targets)
        Routed rates (engines or groups), ≥ 0.
    shed_rps : array_like, shape (n_classes,)
        Shed rates.
    demand_rps : array_like, shape (n_classes,)
        The demands the LP was solved for.
    fallback : array_like, shape (n_classes, n_targets), optional
        Non-negative rows used (normalised) for classes that have no allocation but are not fully
        shed, e.g. zero-demand classes; typically eligible effective capacity.
    min_rate_rps : float
        Row totals at or below this are "no allocation".

    Returns
    -------
    weights : ndarray, shape (n_classes, n_targets)
        Rows summing to 1, or all zero.
    shed_fraction : ndarray, shape (n_classes,)
        ``σ_g ∈ [0, 1]``; 0 for zero-demand classes.
    """
    x = np.asarray(x_rps, dtype=np.float64)
    shed = np.asarray(shed_rps, dtype=np.float64)
    demand = np.asarray(demand_rps, dtype=np.float64)
    if x.ndim != 2 or shed.shape != (x.shape[0],) or demand.shape != shed.shape:
        raise ValueError(f"shapes disagree: x {x.shape}, shed {shed.shape}, demand {demand.shape}")
    total = x.sum(axis=1)
    has = total > min_rate_rps
    weights = np.zeros_like(x)
    np.divide(x, total[:, None], out=weights, where=has[:, None])
    sigma = np.clip(np.divide(shed, demand, out=np.zeros_like(shed), where=demand > 0), 0.0, 1.0)
    if fallback is not None:
        fb = np.asarray(fallback, dtype=np.float64)
        if fb.shape != x.shape or np.any(~np.isfinite(fb)) or np.any(fb < 0):
            raise ValueError("fallback must be finite, >= 0 and shaped like x_rps")
        fb_total = fb.sum(axis=1)
        use = ~has & (sigma < 1.0) & (fb_total > 0)
        weights[use] = fb[use] / fb_total[use, None]
    return weights, sigma


def engine_weights(group_weights: npt.ArrayLike, groups: EngineGroups) -> FloatArray:
    """Engine-level weight rows from group-level rows (split ∝ effective capacity).

    A row keeps its sum (1 or 0); weight on a group with zero capacity is dropped and the row
    renormalised.
    """
    wg = np.asarray(group_weights, dtype=np.float64)
    return groups.split(_normalised_group_rows(wg, groups))


def _normalised_group_rows(wg: FloatArray, groups: EngineGroups) -> FloatArray:
    """Group rows that split into engine rows summing to 1 (or 0).

    Normalise on the (classes × groups) rows, then gather to engines: the members' shares of a
    group with capacity sum to 1, so a row's engine sum is its weight on such groups (one pass
    over the dense classes × engines matrix instead of three).
    """
    if wg.ndim != 2 or wg.shape[1] != groups.n_groups:
        raise ValueError(f"expected (n_classes, {groups.n_groups}) group rows, got {wg.shape}")
    wg = np.where(groups.capacity_rps > 0, wg, 0.0)
    total = wg.sum(axis=1, keepdims=True)
    return np.divide(wg, total, out=np.zeros_like(wg), where=total > 0)


def region_engine_weights(
    group_weights: npt.ArrayLike,
    groups: EngineGroups,
    class_rows: npt.ArrayLike,
    engine_cols: npt.ArrayLike,
) -> FloatArray:
    """The block ``engine_weights(group_weights, groups)[class_rows][:, engine_cols]``, built
    without the dense classes × engines matrix.

    A region's table needs only its own classes' rows and the engines they may use; at
    100 regions × 10 000 engines × 50 classes per region that block is 50 × 400 against the
    5 000 × 10 000 whole (docs/controller.md, "Plan at scale"). ``engine_cols`` must hold every
    engine the rows may use (e.g. their eligible engines), or the block's rows do not sum to 1.
    """
    rows = np.asarray(class_rows, dtype=np.intp)
    cols = np.asarray(engine_cols, dtype=np.intp)
    wg = np.asarray(group_weights, dtype=np.float64)
    if wg.ndim != 2:
        raise ValueError(f"expected (n_classes, {groups.n_groups}) group rows, got {wg.shape}")
    wg = _normalised_group_rows(wg[rows], groups)  # per row, so only the region's rows
    gid = groups.group_of_engine[cols]
    gcap = groups.capacity_rps[gid]
    eff = groups.engine_capacity_rps[cols]
    share = np.divide(eff, gcap, out=np.zeros_like(gcap), where=gcap > 0)
    return wg[:, gid] * share


def validate_weights(
    weights: npt.ArrayLike, shed_fraction: npt.ArrayLike, *, atol: float = 1e-9
) -> None:
    """Check rows before publishing: finite, ≥ 0, each row sums to 1 or is all zero.

    The first two are the table's own rule (:func:`fastroute.tables.check_weights`).

    Raises
    ------
    TableValueError
        Naming the first offending class row and what was found.
    """
    w = np.asarray(weights, dtype=np.float64)
    sigma = np.asarray(shed_fraction, dtype=np.float64)
    if w.ndim != 2 or sigma.shape != (w.shape[0],):
        raise TableValueError(
            f"expected weights (n_classes, n_engines) and shed (n_classes,), "
            f"got {w.shape} and {sigma.shape}"
        )
    check_weights(w)
    sums = w.sum(axis=1)
    bad = ~(np.isclose(sums, 1.0, rtol=0.0, atol=atol) | (sums == 0.0))
    if bad.any():
        g = int(np.argmax(bad))
        raise TableValueError(
            f"class row {g}: weights must sum to 1 or be all zero, sum {sums[g]!r}"
        )
    if not np.all(np.isfinite(sigma)) or np.any((sigma < 0) | (sigma > 1)):
        raise TableValueError(f"shed fractions must lie in [0, 1], got {sigma}")


def churn(
    weights_prev: npt.ArrayLike, weights_now: npt.ArrayLike, demand_rps: npt.ArrayLike
) -> float:
    """Demand-weighted total-variation distance between two weight tables (0 … 1).

    ``TV = ½ Σ_g D_g Σ_e |w_now − w_prev| / Σ_g D_g``; 0 when there is no demand.
    """
    w0 = np.asarray(weights_prev, dtype=np.float64)
    w1 = np.asarray(weights_now, dtype=np.float64)
    demand = np.asarray(demand_rps, dtype=np.float64)
    if w0.shape != w1.shape or w0.ndim != 2 or demand.shape != (w0.shape[0],):
        raise ValueError(f"shapes disagree: {w0.shape}, {w1.shape}, demand {demand.shape}")
    total = float(demand.sum())
    if total <= 0:
        return 0.0
    return float(0.5 * demand @ np.abs(w1 - w0).sum(axis=1) / total)


def table_anchor(
    x_prev_rps: npt.ArrayLike, demand_prev_rps: npt.ArrayLike, demand_rps: npt.ArrayLike
) -> FloatArray:
    """The rates the published table sends at the new demand: ``x_ge · D'_g / D_g``.

    Parameters
    ----------
    x_prev_rps : array_like, shape (n_classes, n_targets)
        The previous solution (≥ 0), the one whose weights are published.
    demand_prev_rps : array_like, shape (n_classes,)
        The demands it was solved for.
    demand_rps : array_like, shape (n_classes,)
        The demands of the coming solve.

    Returns
    -------
    ndarray, shape (n_classes, n_targets)
        The anchor ``x⁰`` for :meth:`controller.solve.RoutingLP.solve`; rows of classes whose
        previous demand was 0 are 0 (no table row to keep).
    """
    x = np.asarray(x_prev_rps, dtype=np.float64)
    d0 = np.asarray(demand_prev_rps, dtype=np.float64)
    d1 = np.asarray(demand_rps, dtype=np.float64)
    if x.ndim != 2 or d0.shape != (x.shape[0],) or d1.shape != d0.shape:
        raise ValueError(f"shapes disagree: x {x.shape}, demands {d0.shape} and {d1.shape}")
    both = np.concatenate([d0, d1])
    if not np.all(np.isfinite(both)) or np.any(both < 0):
        raise ValueError("demands must be finite and >= 0")
    scale = np.divide(d1, d0, out=np.zeros_like(d1), where=d0 > 0)
    return x * scale[:, None]


def shed_at_demand(
    x_rps: npt.ArrayLike,
    shed_rps: npt.ArrayLike,
    demand_rps: npt.ArrayLike,
    *,
    min_rate_rps: float = 1e-9,
) -> FloatArray:
    """Shed fractions that admit the LP's routed rate of each shed class out of ``demand_rps``.

    Parameters
    ----------
    x_rps : array_like, shape (n_classes, n_targets)
        Routed rates of the solution (≥ 0).
    shed_rps : array_like, shape (n_classes,)
        Its shed rates; only classes with ``shed > 0`` (capacity-bound) are shed.
    demand_rps : array_like, shape (n_classes,)
        The live demand estimate (not necessarily the one the LP was solved for).
    min_rate_rps : float
        Routed totals at or below this are no allocation (as in :func:`class_weights`), so a
        class with an all-zero row is shed fully, exactly 1.

    Returns
    -------
    ndarray, shape (n_classes,)
        ``clip(1 − Σ_e x_ge / D_g, 0, 1)`` for shed classes, 0 for the others; equals
        :func:`class_weights`' ``shed / D`` when ``demand_rps`` is the solved-for demand.
    """
    x = np.asarray(x_rps, dtype=np.float64)
    shed = np.asarray(shed_rps, dtype=np.float64)
    demand = np.asarray(demand_rps, dtype=np.float64)
    if x.ndim != 2 or shed.shape != (x.shape[0],) or demand.shape != shed.shape:
        raise ValueError(f"shapes disagree: x {x.shape}, shed {shed.shape}, demand {demand.shape}")
    if not np.all(np.isfinite(demand)) or np.any(demand < 0):
        raise ValueError("demand_rps must be finite and >= 0")
    routed = x.sum(axis=1)
    routed = np.where(routed > min_rate_rps, routed, 0.0)
    admitted = np.divide(routed, demand, out=np.ones_like(demand), where=demand > 0)
    return np.where(shed > 0, np.clip(1.0 - admitted, 0.0, 1.0), 0.0)
