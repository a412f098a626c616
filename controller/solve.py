"""Solve the routing LP with HiGHS (dual simplex), warm-starting from the previous basis.

Solve policy (docs/controller.md, docs/algorithms.md §1.5–1.7):

* :class:`RoutingLP` owns one ``highspy.Highs`` object. The first solve, and any solve whose
  *structure* (eligible pairs, number of classes and engines/groups, segments K) differs from the
  last one, passes a freshly built model (``passModel``). Otherwise only the vectors are updated
  (``changeColsCost``, ``changeColsBounds``, ``changeRowsBounds``, ``changeObjectiveOffset``) and
  HiGHS continues dual simplex from the incumbent basis; re-anchoring at the previous solution
  keeps that basis dual feasible, and unchanged data re-solve in 0 iterations.
* A structure change that only *adds* eligible pairs (same classes, engines and K; what
  :class:`controller.sifting.SiftingLP` does between pricing rounds) appends their columns to
  the kept model (``addCols``): HiGHS keeps the basis, the new columns start nonbasic at 0, and
  it continues from the previous optimum instead of starting cold. A permutation maps the
  canonical ``[p, q, s, shed]`` order of :func:`controller.lp.build_lp` to HiGHS's columns.
  ``warm`` is False for such a solve (the structure changed).
* Anything but ``Optimal`` raises :class:`SolveError` carrying HiGHS's model-status string; the
  caller keeps publishing the last good table. The next solve after a failure starts cold.
* Results are checked: primal values below ``−tolerance`` (scaled by the largest demand) or
  non-finite raise :class:`SolveError`; smaller negative noise is clipped to 0.

Options: ``time_limit_s`` (HiGHS ``time_limit``), ``threads``, ``dual_edge_weight`` (Devex by
default); output is silenced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import highspy
import numpy as np
import numpy.typing as npt

from controller.lp import LPArrays, RoutingProblem, build_lp, lp_vectors
from fastroute.errors import FastrouteError

__all__ = ["DUAL_EDGE_WEIGHTS", "RoutingLP", "SolveError", "SolveResult"]

FloatArray = npt.NDArray[np.float64]
Int32Array = npt.NDArray[np.int32]

_OPTIMAL = highspy.HighsModelStatus.kOptimal
_SIMPLEX_STRATEGY_DUAL = 1
_SIMPLEX_STRATEGY_PRIMAL = 4
#: HiGHS ``simplex_dual_edge_weight_strategy`` by name.
DUAL_EDGE_WEIGHTS: dict[str, int] = {"dantzig": 0, "devex": 1, "steepest-edge": 2}


class SolveError(FastrouteError):
    """The routing LP has no usable optimal solution.

    Parameters
    ----------
    status : str
        HiGHS's model status (``Highs.modelStatusToString``), e.g. ``"Infeasible"`` or
        ``"Time limit reached"``.
    detail : str
        What was being done or checked.

    Attributes
    ----------
    status : str
        As given.
    """

    def __init__(self, status: str, detail: str = "") -> None:
        self.status = status
        self.detail = detail
        super().__init__(
            f"routing LP not solved: model status {status!r}" + (f"; {detail}" if detail else "")
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (SolveError, (self.status, self.detail))


@dataclass(frozen=True, eq=False)
class SolveResult:
    """One optimal routing solution.

    Attributes
    ----------
    x_rps : ndarray, shape (n_classes, n_engines)
        Routed rate per (class, engine or group); 0 outside eligible pairs; finite, ≥ 0.
    shed_rps : ndarray, shape (n_classes,)
        Rate shed per class.
    objective : float
        Total expected latency rate + move cost + shed penalty (s·req/s), including the constant
        ``Σ d x⁰``.
    marginal_cost_s : ndarray, shape (n_classes,)
        Duals of the demand rows: the objective increase per extra unit of class demand (s).
    load_rps : ndarray, shape (n_engines,)
        ``Σ_g x_ge``.
    status : str
        HiGHS model status string (``"Optimal"``).
    iterations : int
        Simplex iterations of this solve.
    solve_time_s : float
        Wall time of ``Highs.run``.
    build_time_s : float
        Wall time spent building or updating the model before ``run``.
    warm : bool
        Whether the model was updated in place (else built and passed anew).
    link_dual_s : ndarray, shape (n_engines,), optional
        Duals of the link rows (s): with ``marginal_cost_s`` they price any pair column,
        ``reduced cost = d + κ − marginal_cost_s[g] − link_dual_s[e]`` (column generation).
    shed_segment_rps : ndarray, shape (n_shed,), optional
        Each shed column's value when the problem has shed segments (``shed_rps`` sums them per
        class); None otherwise.
    """

    x_rps: FloatArray
    shed_rps: FloatArray
    objective: float
    marginal_cost_s: FloatArray
    load_rps: FloatArray
    status: str
    iterations: int
    solve_time_s: float
    build_time_s: float
    warm: bool
    link_dual_s: FloatArray | None = None
    shed_segment_rps: FloatArray | None = None


def _same_shed_columns(problem: RoutingProblem, arrays: LPArrays) -> bool:
    """Whether ``problem`` has the shed columns the model was built with."""
    if problem.shed_segment_class is None or arrays.shed_class is None:
        return problem.shed_segment_class is None and arrays.shed_class is None
    return bool(np.array_equal(problem.shed_segment_class, arrays.shed_class))


class RoutingLP:
    """A re-solvable routing LP bound to one ``highspy.Highs`` instance.

    Parameters
    ----------
    time_limit_s : float, optional
        HiGHS time limit per solve; exceeding it raises ``SolveError("Time limit reached")``.
    threads : int
        HiGHS ``threads`` option (1 keeps the controller on one core).
    tolerance : float
        Relative tolerance for negative primal noise (× max(1, max demand)).
    dual_edge_weight : {"devex", "steepest-edge", "dantzig"}
        Dual simplex pricing. Devex (default): on these network-like LPs warm periods took
        15–35 % fewer pivots than steepest edge and 1.2–1.6× less CPU (sifted 50 × 500: 145 vs
        230 ms; 50 × 2000 grouped: 3.2 vs 4.1 ms; docs/controller.md "Measured").

    Examples
    --------
    >>> lp = RoutingLP(time_limit_s=1.0)
    >>> first = lp.solve(problem)                       # doctest: +SKIP
    >>> nxt = lp.solve(new_problem, x_prev_rps=first.x_rps)  # warm when the structure is unchanged
    """

    def __init__(
        self,
        *,
        time_limit_s: float | None = None,
        threads: int = 1,
        tolerance: float = 1e-7,
        dual_edge_weight: str = "devex",
    ) -> None:
        if dual_edge_weight not in DUAL_EDGE_WEIGHTS:
            raise ValueError(
                f"dual_edge_weight must be one of {', '.join(DUAL_EDGE_WEIGHTS)}, "
                f"got {dual_edge_weight!r}"
            )
        self._highs = highspy.Highs()
        self._highs.setOptionValue("output_flag", False)
        self._highs.setOptionValue("solver", "simplex")
        self._highs.setOptionValue("simplex_strategy", _SIMPLEX_STRATEGY_DUAL)
        self._highs.setOptionValue(
            "simplex_dual_edge_weight_strategy", DUAL_EDGE_WEIGHTS[dual_edge_weight]
        )
        self._highs.setOptionValue("threads", int(threads))
        self._highs.setOptionValue("time_limit", np.inf if time_limit_s is None else time_limit_s)
        self._tolerance = tolerance
        self._arrays: LPArrays | None = None
        self._all_rows: npt.NDArray[np.int32] | None = None
        # canonical column (the [p, q, s, shed] order of ``_arrays``) -> HiGHS column; appended
        # pairs make it a permutation
        self._perm: npt.NDArray[np.int32] | None = None
        # what HiGHS holds, by HiGHS column: updates pass only the entries that differ
        self._model_cost: FloatArray | None = None
        self._model_upper: FloatArray | None = None

    @property
    def time_limit_s(self) -> float:
        """The current HiGHS time limit (s); ``inf`` when unlimited."""
        return float(self._highs.getOptionValue("time_limit"))

    @time_limit_s.setter
    def time_limit_s(self, value: float | None) -> None:
        self._highs.setOptionValue("time_limit", np.inf if value is None else float(value))

    def reset(self) -> None:
        """Forget the model and basis; the next solve starts cold."""
        self._highs.clearModel()
        self._arrays = None
        self._perm = self._model_cost = self._model_upper = None

    def _same_structure(self, problem: RoutingProblem) -> bool:
        a = self._arrays
        if a is None:
            return False
        if (problem.n_classes, problem.n_engines, problem.n_segments) != (
            a.n_classes,
            a.n_engines,
            a.n_segments,
        ):
            return False
        gi, ei = np.nonzero(problem.eligible)
        return (
            np.array_equal(gi, a.class_index)
            and np.array_equal(ei, a.engine_index)
            and _same_shed_columns(problem, a)
        )

    def _added_pairs(self, problem: RoutingProblem) -> tuple[Int32Array, Int32Array] | None:
        """If ``problem`` only adds pairs to the model: (new canonical pairs' positions of the
        old pairs, positions of the added pairs); else None."""
        a = self._arrays
        if a is None or (problem.n_classes, problem.n_engines, problem.n_segments) != (
            a.n_classes,
            a.n_engines,
            a.n_segments,
        ):
            return None
        if int(self._highs.getInfo().basis_validity) != 1:  # kBasisValidityValid
            return None
        if not _same_shed_columns(problem, a):
            return None
        gi, ei = np.nonzero(problem.eligible)
        n_e = a.n_engines
        new_keys = gi.astype(np.int64) * n_e + ei
        old_keys = a.class_index.astype(np.int64) * n_e + a.engine_index
        pos = np.searchsorted(new_keys, old_keys)
        if pos.size and (pos[-1] >= new_keys.size or not np.array_equal(new_keys[pos], old_keys)):
            return None  # some old pair is gone: not a pure addition
        added = np.ones(new_keys.size, dtype=bool)
        added[pos] = False
        return pos.astype(np.int32), np.flatnonzero(added).astype(np.int32)

    def _append(
        self,
        problem: RoutingProblem,
        x_prev_rps: npt.ArrayLike | None,
        old_pos: Int32Array,
        new_pos: Int32Array,
    ) -> None:
        """Add the new pairs' p and q columns to the model (HiGHS keeps the basis: the new
        columns are nonbasic at 0), then update the vectors in place."""
        a = self._arrays
        assert a is not None and self._perm is not None
        assert self._model_cost is not None and self._model_upper is not None
        gi, ei = np.nonzero(problem.eligible)
        g = gi.astype(np.int32)
        e = ei.astype(np.int32)
        v = lp_vectors(problem, g, e, x_prev_rps)
        n_a_old, n_a, k = a.n_pairs, g.size, new_pos.size
        n_model = self._model_cost.size
        perm = np.empty(2 * n_a + a.n_engines * a.n_segments + a.n_shed, dtype=np.int32)
        perm[old_pos] = self._perm[:n_a_old]
        perm[new_pos] = n_model + np.arange(k, dtype=np.int32)
        perm[n_a + old_pos] = self._perm[n_a_old : 2 * n_a_old]
        perm[n_a + new_pos] = n_model + k + np.arange(k, dtype=np.int32)
        perm[2 * n_a :] = self._perm[2 * n_a_old :]
        canon = np.concatenate([new_pos, n_a + new_pos])  # canonical index of each added column
        rows = np.empty(2 * k, dtype=np.int32)
        rows[0::2] = g[new_pos]
        rows[1::2] = a.n_classes + e[new_pos]
        index = np.concatenate([rows, rows])
        value = np.concatenate([np.ones(2 * k), -np.ones(2 * k)])
        starts = np.arange(0, 4 * k, 2, dtype=np.int32)
        cost, upper = v.cost[canon], v.upper[canon]
        if k and (
            self._highs.addCols(2 * k, cost, np.zeros(2 * k), upper, 4 * k, starts, index, value)
            == highspy.HighsStatus.kError
        ):
            self.reset()
            raise SolveError(self._status_string(), "addCols rejected the new pairs")
        self._perm = perm
        self._model_cost = np.concatenate([self._model_cost, cost])
        self._model_upper = np.concatenate([self._model_upper, upper])
        empty_i = np.empty(0, dtype=np.int32)
        arrays = LPArrays(
            n_classes=a.n_classes,
            n_engines=a.n_engines,
            n_segments=a.n_segments,
            class_index=g,
            engine_index=e,
            a_start=empty_i,  # the matrix lives in HiGHS; only a rebuild needs it (build_lp)
            a_index=empty_i,
            a_value=np.empty(0),
            vectors=v,
            shed_class=a.shed_class,
        )
        self._push(arrays)

    def _pass_model(self, arrays: LPArrays) -> None:
        v = arrays.vectors
        lp = highspy.HighsLp()
        lp.num_col_ = arrays.n_cols
        lp.num_row_ = arrays.n_rows
        lp.col_cost_ = v.cost
        lp.col_lower_ = np.zeros(arrays.n_cols)
        lp.col_upper_ = v.upper
        lp.row_lower_ = v.rhs
        lp.row_upper_ = v.rhs
        lp.offset_ = v.offset
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = arrays.a_start
        lp.a_matrix_.index_ = arrays.a_index
        lp.a_matrix_.value_ = arrays.a_value
        self._highs.clearModel()
        status = self._highs.passModel(lp)
        if status == highspy.HighsStatus.kError:
            self._arrays = None
            raise SolveError(self._status_string(), "passModel rejected the LP")
        self._arrays = arrays
        self._all_rows = np.arange(arrays.n_rows, dtype=np.int32)
        self._perm = np.arange(arrays.n_cols, dtype=np.int32)
        self._model_cost = v.cost.copy()
        self._model_upper = v.upper.copy()

    def _update(self, problem: RoutingProblem, x_prev_rps: npt.ArrayLike | None) -> None:
        a = self._arrays
        assert a is not None
        v = lp_vectors(problem, a.class_index, a.engine_index, x_prev_rps)
        self._push(replace(a, vectors=v))

    def _push(self, arrays: LPArrays) -> None:
        """Make the model hold ``arrays.vectors`` (same structure), passing only what differs.

        Per period the costs rarely change and only the q bounds of anchored pairs do; passing
        every entry took 13–45 ms at 54 k columns, HiGHS's per-entry bookkeeping.
        """
        perm, cost_now, upper_now = self._perm, self._model_cost, self._model_upper
        assert perm is not None and cost_now is not None and upper_now is not None
        assert self._all_rows is not None
        v = arrays.vectors
        cost = np.empty_like(cost_now)
        cost[perm] = v.cost
        upper = np.empty_like(upper_now)
        upper[perm] = v.upper
        h = self._highs
        ok = highspy.HighsStatus.kError
        cost_idx = np.flatnonzero(cost != cost_now).astype(np.int32)
        bound_idx = np.flatnonzero(upper != upper_now).astype(np.int32)
        if (
            (cost_idx.size and h.changeColsCost(cost_idx.size, cost_idx, cost[cost_idx]) == ok)
            or (
                bound_idx.size
                and h.changeColsBounds(
                    bound_idx.size, bound_idx, np.zeros(bound_idx.size), upper[bound_idx]
                )
                == ok
            )
            or h.changeRowsBounds(arrays.n_rows, self._all_rows, v.rhs, v.rhs) == ok
            or h.changeObjectiveOffset(v.offset) == ok
        ):
            self.reset()
            raise SolveError(self._status_string(), "updating the LP in place failed")
        self._model_cost, self._model_upper = cost, upper
        self._arrays = arrays

    def _status_string(self) -> str:
        return str(self._highs.modelStatusToString(self._highs.getModelStatus()))

    def solve(
        self,
        problem: RoutingProblem,
        x_prev_rps: npt.ArrayLike | None = None,
        *,
        primal: bool = False,
    ) -> SolveResult:
        """Solve ``problem`` anchored at ``x_prev_rps`` (the previous published solution).

        Parameters
        ----------
        problem : RoutingProblem
        x_prev_rps : array_like, shape (n_classes, n_engines), optional
            Anchor ``x⁰``; default zeros. For a warm start pass the previous ``x_rps``.
        primal : bool
            Run primal instead of dual simplex: right when the carried basis is primal feasible
            but not dual feasible, i.e. after only adding columns with the same data and anchor
            (column generation); ~10× fewer pivots there.

        Returns
        -------
        SolveResult

        Raises
        ------
        SolveError
            HiGHS did not reach ``Optimal`` (infeasible without shedding, time limit, …) or the
            solution failed the finiteness / non-negativity check.
        ValueError
            ``x_prev_rps`` has the wrong shape or negative / non-finite entries.
        """
        t0 = time.perf_counter()
        warm = self._same_structure(problem)
        if warm:
            self._update(problem, x_prev_rps)
        else:
            grown = self._added_pairs(problem)
            if grown is not None:
                self._append(problem, x_prev_rps, *grown)
            else:
                self._pass_model(build_lp(problem, x_prev_rps))
        t1 = time.perf_counter()
        if primal:
            self._highs.setOptionValue("simplex_strategy", _SIMPLEX_STRATEGY_PRIMAL)
        try:
            self._highs.run()
        finally:
            if primal:
                self._highs.setOptionValue("simplex_strategy", _SIMPLEX_STRATEGY_DUAL)
        t2 = time.perf_counter()
        status = self._highs.getModelStatus()
        if status != _OPTIMAL:
            text = self._status_string()
            self.reset()
            raise SolveError(text, f"{problem.n_classes} classes x {problem.n_engines} engines")
        return self._result(problem, warm, t1 - t0, t2 - t1)

    def _result(
        self, problem: RoutingProblem, warm: bool, build_s: float, solve_s: float
    ) -> SolveResult:
        a = self._arrays
        assert a is not None
        sol = self._highs.getSolution()
        assert self._perm is not None
        col = np.asarray(sol.col_value, dtype=np.float64)[self._perm]  # canonical order
        row_dual = np.asarray(sol.row_dual, dtype=np.float64)
        n_a, n_g, n_e = a.n_pairs, a.n_classes, a.n_engines
        x_pairs = a.vectors.x_prev_pairs + col[:n_a] - col[n_a : 2 * n_a]
        shed = col[a.n_cols - a.n_shed :]
        tol = self._tolerance * max(1.0, float(problem.demand_rps.max(initial=0.0)))
        for name, arr in (("x", x_pairs), ("shed", shed)):
            if not np.all(np.isfinite(arr)) or (arr.size and arr.min() < -tol):
                self.reset()
                raise SolveError(
                    "Optimal", f"{name} has non-finite or negative values (min {arr.min():.3g})"
                )
        x_pairs = np.maximum(x_pairs, 0.0)
        shed = np.maximum(shed, 0.0)
        segments = None
        if a.shed_class is not None:
            segments, shed = shed, np.bincount(a.shed_class, shed, n_g)
        x = np.zeros((n_g, n_e))
        x[a.class_index, a.engine_index] = x_pairs
        info = self._highs.getInfo()
        return SolveResult(
            x_rps=x,
            shed_rps=shed,
            objective=float(info.objective_function_value),
            marginal_cost_s=row_dual[:n_g].copy(),
            link_dual_s=row_dual[n_g:].copy(),
            load_rps=x.sum(axis=0),
            status="Optimal",
            iterations=int(info.simplex_iteration_count),
            solve_time_s=solve_s,
            build_time_s=build_s,
            warm=warm,
            shed_segment_rps=segments,
        )
