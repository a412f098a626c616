"""Aggregation of demand classes for the routing LP (the analogue of engine groups).

Algorithm (docs/controller.md "Plan at scale", docs/algorithms.md §1.8). Every LP coefficient of
a class ``g`` sits in its row of the problem (:class:`controller.lp.RoutingProblem`): the
eligibility row ``A_g·``, the network latency ``d_g·`` on it, the move penalty ``κ_g·`` on it and
the shed weight ``π_g`` (hence ``P_g = π_g P₀``); its demand ``D_g`` is only a right-hand side
and a bound. Classes whose rows agree in all four are *interchangeable*. An aggregate ``a`` of
such classes is one LP class with demand ``D_a = Σ_{g∈a} D_g``, the common rows, and anchor
``x⁰_a· = Σ_{g∈a} x⁰_g·``; its solution is split back in proportion to demand,
``x_g· = (D_g / D_a) x_a·`` and ``shed_g = (D_g / D_a) shed_a`` (:meth:`ClassGroups.split`), so
each class's weight row and shed fraction are its aggregate's.

Why the split is optimal for the class LP (``f`` its objective, ``f_a`` the aggregated one):

* ``f_a* ≤ f*``: summing any feasible class solution over each aggregate is feasible for the
  aggregated LP (demand rows add up; link rows and segments are unchanged), with the same
  latency, segment and shed cost (linear, equal coefficients) and a move term no larger, since
  ``Σ_g |x_ge − x⁰_ge| ≥ |Σ_g x_ge − Σ_g x⁰_ge|`` (triangle inequality).
* The split of an optimal aggregated solution is feasible for the class LP (each class gets
  ``D_g / D_a`` of every row, shed ``≤ D_g`` included) with the same cost except the move term,
  which is ``Σ_g |(D_g/D_a) x_ae − x⁰_ge|``. When the anchors are proportional to demand,
  ``x⁰_g· = (D_g / D_a) x⁰_a·``, this equals ``|x_ae − x⁰_ae|``, so the split attains
  ``f_a* ≤ f*``: it is optimal. The planner's anchor is the table in force at the new demand
  (``controller.weights.table_anchor``: row ``g`` = previous row × ``D'_g / D_g``); after a split
  period every member of an aggregate has the same row shape, so the anchor is proportional to
  the new demand and the aggregation is exact period after period.
* When the members' previous rows differ (the first period after the partition changed, or an
  anchor from an unaggregated solve), the aggregated LP is still a relaxation (``f_a* ≤ f*``) and
  the split still feasible, but it is optimal only up to the anchor's spread:
  ``f(split) − f* ≤ κ Σ_g Σ_e |x⁰_ge − (D_g / D_a) x⁰_ae|`` (triangle inequality through the
  proportional anchor). Latency, load and shed are those of an optimum of the relaxation; only
  the move charge is approximate, and one period later the anchor is proportional again.

The dual of an aggregate's demand row is a valid demand dual (marginal cost) of each member:
every member column has its aggregate column's reduced cost.

**Across priorities** (``across_priorities``, the planner's default): classes equal in all but
``π_g`` route alike and differ only in which sheds first. The aggregate then keeps one shed
column per member (``shed_segment_*`` of :class:`controller.lp.RoutingProblem`: up to ``D_g`` at
``π_g P₀``), each member sheds its own column, and routing is split in proportion to the routed
rate ``r_g = D_g − shed_g``: ``x_g· = (r_g / r_a) x_a·``. The relaxation argument is unchanged
(summing keeps every shed column), and the split attains ``f_a*`` when
``x⁰_g· = (r_g / r_a) x⁰_a·``. The table anchor is the previous routed row scaled by
``D'_g / D_g``, so this holds whenever ``(1 − σ_g) / (1 − σ⁰_g)`` is the same for the members
(in particular when nothing is shed, or the shed fractions hold); otherwise
``f(split) − f* ≤ κ Σ_g Σ_e |x⁰_ge − (r_g / r_a) x⁰_ae|``. A member's marginal cost is
``min(π_a, P_g)`` (a fully shed member's extra demand is shed as well).

The partition (:func:`group_classes`) hashes each class's row bytes once, O(classes × groups);
:class:`AggregatedLP` keeps it while the problem's rows are the same objects or equal (an identity
check on the planner's path), so a period that only changes demand, capacity, health or the anchor
pays no hashing, only a sum and a split over the dense classes × groups rows it already holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from controller.lp import RoutingProblem
from controller.sifting import SiftingLP
from controller.solve import RoutingLP, SolveResult

__all__ = ["AggregatedLP", "ClassGroups", "aggregate_problem", "group_classes"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]


@dataclass(frozen=True, eq=False)
class ClassGroups:
    """A partition of classes into interchangeable aggregates.

    Attributes
    ----------
    group_of_class : ndarray of intp, shape (n_classes,)
        Aggregate of every class (numbered by first appearance).
    representative : ndarray of intp, shape (n_groups,)
        The first class of each aggregate (whose rows the aggregate takes).
    order : ndarray of intp, shape (n_classes,)
        Classes sorted by aggregate (stable).
    starts : ndarray of intp, shape (n_groups,)
        Where each aggregate's classes start in ``order``.
    across_priorities : bool
        Shed weights were left out of the key: an aggregate sheds through one column per member
        (:func:`aggregate_problem`).
    """

    group_of_class: IntArray
    representative: IntArray
    order: IntArray
    starts: IntArray
    across_priorities: bool = False

    @property
    def n_classes(self) -> int:
        """Classes partitioned."""
        return int(self.group_of_class.size)

    @property
    def n_groups(self) -> int:
        """Aggregates."""
        return int(self.representative.size)

    def total(self, per_class: npt.ArrayLike) -> FloatArray:
        """Sum a ``(n_classes,)`` or ``(n_classes, m)`` array over each aggregate."""
        v = np.asarray(per_class, dtype=np.float64)
        if v.shape[:1] != (self.n_classes,):
            raise ValueError(f"expected {self.n_classes} class entries, got shape {v.shape}")
        if v.ndim == 1:
            return np.bincount(self.group_of_class, v, self.n_groups)
        if self.n_groups == self.n_classes:  # no two classes alike: the identity partition
            return v[self.representative]
        # sort-and-reduce: ~20x faster than np.add.at over thousands of classes × groups
        return np.add.reduceat(v[self.order], self.starts, axis=0)

    def split(
        self, x_group: npt.ArrayLike, demand_rps: npt.ArrayLike, demand_group_rps: npt.ArrayLike
    ) -> FloatArray:
        """Aggregate rows (``(n_groups,)`` or ``(n_groups, m)``) split to classes ∝ demand.

        A class of an aggregate with zero demand gets zeros.
        """
        xa = np.asarray(x_group, dtype=np.float64)
        d = np.asarray(demand_rps, dtype=np.float64)
        da = np.asarray(demand_group_rps, dtype=np.float64)[self.group_of_class]
        share = np.divide(d, da, out=np.zeros_like(d), where=da > 0)
        rows = xa[self.group_of_class]
        return rows * (share if rows.ndim == 1 else share[:, None])


def group_classes(
    problem: RoutingProblem, decimals: int = 9, *, across_priorities: bool = False
) -> ClassGroups:
    """Partition ``problem``'s classes by (eligibility, latency, κ, shed weight) rows.

    Latency and κ are compared rounded to ``decimals`` and only on eligible pairs (elsewhere the
    LP has no column), as :func:`controller.groups.engine_locations` does for engines;
    ``across_priorities`` leaves the shed weight out of the key (module doc).
    """
    if problem.shed_segment_class is not None:
        raise ValueError("the problem already has shed segments (aggregated once)")
    elig = problem.eligible
    dist = np.round(np.where(elig, problem.network_latency_s, 0.0), decimals) + 0.0
    kappa = problem.kappa_matrix_s
    kappa_rows = (
        np.zeros((elig.shape[0], 1)) + float(kappa.flat[0])
        if kappa.size and kappa.strides == (0, 0)  # a scalar κ: one value per class suffices
        else np.round(np.where(elig, kappa, 0.0), decimals) + 0.0
    )
    pi = np.round(problem.shed_weight, decimals) + 0.0
    if across_priorities:
        pi = np.zeros_like(pi)
    elig_b = np.ascontiguousarray(elig)
    dist_b = np.ascontiguousarray(dist)
    kappa_b = np.ascontiguousarray(kappa_rows)
    index_of_key: dict[bytes, int] = {}
    group_of_class = np.fromiter(
        (
            index_of_key.setdefault(
                elig_b[i].tobytes() + dist_b[i].tobytes() + kappa_b[i].tobytes() + pi[i].tobytes(),
                len(index_of_key),
            )
            for i in range(elig.shape[0])
        ),
        dtype=np.intp,
        count=elig.shape[0],
    )
    n = len(index_of_key)
    reps = np.full(n, elig.shape[0], dtype=np.intp)
    np.minimum.at(reps, group_of_class, np.arange(elig.shape[0]))
    order = np.argsort(group_of_class, kind="stable")
    starts = np.searchsorted(group_of_class[order], np.arange(n))
    return ClassGroups(group_of_class, reps, order, starts, across_priorities)


def aggregate_problem(problem: RoutingProblem, classes: ClassGroups) -> RoutingProblem:
    """The LP over ``classes``' aggregates: summed demand, the representatives' rows.

    ``P₀`` is fixed to the class problem's (the default depends only on the distinct rows, which
    the aggregates keep, but fixing it makes the shed prices equal by construction).
    """
    reps = classes.representative
    kappa = problem.kappa_matrix_s
    segments: dict[str, npt.NDArray[np.generic] | None] = {}
    if classes.across_priorities:  # one shed column per member, in aggregate order
        o = classes.order
        segments = {
            "shed_segment_class": classes.group_of_class[o],
            "shed_segment_weight": problem.shed_weight[o],
            "shed_segment_rps": problem.demand_rps[o],
        }
    return RoutingProblem(
        demand_rps=classes.total(problem.demand_rps),
        eligible=problem.eligible[reps],
        network_latency_s=problem.network_latency_s[reps],
        capacity_rps=problem.capacity_rps,
        slopes_s=problem.slopes_s,
        widths_rho=problem.widths_rho,
        shed_weight=problem.shed_weight[reps],
        kappa_s=float(kappa.flat[0]) if kappa.size and kappa.strides == (0, 0) else kappa[reps],
        shed_penalty_base_s=problem.shed_penalty_base(),
        allow_shed=problem.allow_shed,
        **segments,  # type: ignore[arg-type]
    )


def _same_rows(a: RoutingProblem, b: RoutingProblem) -> bool:
    """Whether two problems have the same class rows (identity first: O(1) on the usual path)."""

    def same(x: npt.NDArray[np.generic], y: npt.NDArray[np.generic]) -> bool:
        return x is y or (x.shape == y.shape and bool(np.array_equal(x, y)))

    ka, kb = a.kappa_matrix_s, b.kappa_matrix_s
    scalar = ka.strides == (0, 0) and kb.strides == (0, 0) and ka.shape == kb.shape
    return (
        same(a.eligible, b.eligible)
        and same(a.network_latency_s, b.network_latency_s)
        and same(a.shed_weight, b.shed_weight)
        and (
            (scalar and (ka.size == 0 or ka.flat[0] == kb.flat[0]))
            or (not scalar and same(np.asarray(ka), np.asarray(kb)))
        )
    )


class AggregatedLP:
    """A routing LP solver that solves over class aggregates and answers per class.

    Wraps a :class:`controller.solve.RoutingLP` or :class:`controller.sifting.SiftingLP`; the
    partition is kept across solves while the class rows stay the same (module doc), so the
    inner solver sees the same structure and re-solves warm.

    Parameters
    ----------
    inner : RoutingLP or SiftingLP
        Solves the aggregated problem.
    decimals : int
        Rounding of latencies and κ when comparing rows.
    across_priorities : bool
        Also aggregate classes that differ only in shed weight, each member keeping its own shed
        column (module doc: exact while shed fractions hold, the move term bounded otherwise).
    """

    def __init__(
        self, inner: RoutingLP | SiftingLP, *, decimals: int = 9, across_priorities: bool = False
    ) -> None:
        self.inner = inner
        self.decimals = decimals
        self.across_priorities = across_priorities
        self._rows: RoutingProblem | None = None
        self.classes: ClassGroups | None = None

    def reset(self) -> None:
        """Forget the partition and the inner solver's model."""
        self.inner.reset()
        self._rows = self.classes = None

    def partition(self, problem: RoutingProblem) -> ClassGroups:
        """The partition of ``problem``'s classes (cached while its rows are unchanged)."""
        if self.classes is None or self._rows is None or not _same_rows(self._rows, problem):
            self.classes = group_classes(
                problem, self.decimals, across_priorities=self.across_priorities
            )
        self._rows = problem
        return self.classes

    def solve(
        self, problem: RoutingProblem, x_prev_rps: npt.ArrayLike | None = None
    ) -> SolveResult:
        """Solve ``problem`` over its aggregates; the result has one row per class.

        Parameters and errors as :meth:`controller.solve.RoutingLP.solve`; the anchor is summed
        per aggregate (exact when it is proportional to demand within each, module doc).
        """
        classes = self.partition(problem)
        agg = aggregate_problem(problem, classes)
        anchor = None
        if x_prev_rps is not None:
            x0 = np.asarray(x_prev_rps, dtype=np.float64)
            if x0.shape != problem.eligible.shape:
                raise ValueError(
                    f"x_prev_rps has shape {x0.shape}, expected {problem.eligible.shape}"
                )
            anchor = classes.total(x0)
        res = self.inner.solve(agg, anchor)
        if classes.across_priorities:
            return _split_staircase(problem, agg, classes, res)
        d, da = problem.demand_rps, agg.demand_rps
        return replace(
            res,
            x_rps=classes.split(res.x_rps, d, da),
            shed_rps=classes.split(res.shed_rps, d, da),
            marginal_cost_s=res.marginal_cost_s[classes.group_of_class],
        )


def _split_staircase(
    problem: RoutingProblem, agg: RoutingProblem, classes: ClassGroups, res: SolveResult
) -> SolveResult:
    """Per-class result of an aggregate solved with one shed column per member: each member
    sheds its column, and routes in proportion to its routed rate ``D_g − shed_g``."""
    seg = res.shed_segment_rps
    assert seg is not None
    shed = np.empty(classes.n_classes)
    shed[classes.order] = seg
    shed = np.minimum(shed, problem.demand_rps)
    routed = problem.demand_rps - shed
    marginal = np.minimum(
        res.marginal_cost_s[classes.group_of_class],
        problem.shed_weight * agg.shed_penalty_base(),
    )  # a fully shed member's extra demand is shed too: its marginal cost is its P_g
    return replace(
        res,
        x_rps=classes.split(res.x_rps, routed, classes.total(routed)),
        shed_rps=shed,
        marginal_cost_s=marginal,
        shed_segment_rps=None,
    )
