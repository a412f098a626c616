"""Solve the routing LP with HiGHS (dual simplex), warm-starting from the previous basis.

Solve policy (docs/controller.md, reference/algorithms.md §1.5–1.7):

* :class:`RoutingLP` owns one ``highspy.Highs`` object. The first solve, and any solve whose
  *structure* (eligible pairs, number of classes and engines/groups, segments K) differs from the
  last one, passes a freshly built model (``passModel``). Otherwise only the vectors are updated
  (``changeColsCost``, ``changeColsBounds``, ``changeRowsBounds``, ``changeObjectiveOffset``) and
  HiGHS continues dual simplex from the incumbent basis; re-anchoring at the previous solution
  keeps that basis dual feasible, and unchanged data re-solve in 0 iterations.
* Anything but ``Optimal`` raises :class:`SolveError` carrying HiGHS's model-status string; the
  caller keeps publishing the last good table. The next solve after a failure starts cold.
* Results are checked: primal values below ``−tolerance`` (scaled by the largest demand) or
  non-finite raise :class:`SolveError`; smaller negative noise is clipped to 0.

Options: ``time_limit_s`` (HiGHS ``time_limit``), ``threads``; output is silenced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import highspy
import numpy as np
import numpy.typing as npt

from controller.lp import LPArrays, RoutingProblem, build_lp, lp_vectors
from fastroute.errors import FastrouteError

__all__ = ["RoutingLP", "SolveError", "SolveResult"]

FloatArray = npt.NDArray[np.float64]

_OPTIMAL = highspy.HighsModelStatus.kOptimal
_SIMPLEX_STRATEGY_DUAL = 1


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

    Examples
    --------
    >>> lp = RoutingLP(time_limit_s=1.0)
    >>> first = lp.solve(problem)                       # doctest: +SKIP
    >>> nxt = lp.solve(new_problem, x_prev_rps=first.x_rps)  # warm when the structure is unchanged
    """

    def __init__(
        self, *, time_limit_s: float | None = None, threads: int = 1, tolerance: float = 1e-7
    ) -> None:
        self._highs = highspy.Highs()
        self._highs.setOptionValue("output_flag", False)
        self._highs.setOptionValue("solver", "simplex")
        self._highs.setOptionValue("simplex_strategy", _SIMPLEX_STRATEGY_DUAL)
        self._highs.setOptionValue("threads", int(threads))
        self._highs.setOptionValue("time_limit", np.inf if time_limit_s is None else time_limit_s)
        self._tolerance = tolerance
        self._arrays: LPArrays | None = None
        self._all_cols: npt.NDArray[np.int32] | None = None
        self._all_rows: npt.NDArray[np.int32] | None = None

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
        return np.array_equal(gi, a.class_index) and np.array_equal(ei, a.engine_index)

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
        self._all_cols = np.arange(arrays.n_cols, dtype=np.int32)
        self._all_rows = np.arange(arrays.n_rows, dtype=np.int32)

    def _update(self, problem: RoutingProblem, x_prev_rps: npt.ArrayLike | None) -> None:
        a = self._arrays
        assert a is not None and self._all_cols is not None and self._all_rows is not None
        v = lp_vectors(problem, a.class_index, a.engine_index, x_prev_rps)
        h = self._highs
        n_col, n_row = a.n_cols, a.n_rows
        ok = highspy.HighsStatus.kError
        if (
            h.changeColsCost(n_col, self._all_cols, v.cost) == ok
            or h.changeColsBounds(n_col, self._all_cols, np.zeros(n_col), v.upper) == ok
            or h.changeRowsBounds(n_row, self._all_rows, v.rhs, v.rhs) == ok
            or h.changeObjectiveOffset(v.offset) == ok
        ):
            self.reset()
            raise SolveError(self._status_string(), "updating the LP in place failed")
        self._arrays = LPArrays(
            n_classes=a.n_classes,
            n_engines=a.n_engines,
            n_segments=a.n_segments,
            class_index=a.class_index,
            engine_index=a.engine_index,
            a_start=a.a_start,
            a_index=a.a_index,
            a_value=a.a_value,
            vectors=v,
        )

    def _status_string(self) -> str:
        return str(self._highs.modelStatusToString(self._highs.getModelStatus()))

    def solve(
        self, problem: RoutingProblem, x_prev_rps: npt.ArrayLike | None = None
    ) -> SolveResult:
        """Solve ``problem`` anchored at ``x_prev_rps`` (the previous published solution).

        Parameters
        ----------
        problem : RoutingProblem
        x_prev_rps : array_like, shape (n_classes, n_engines), optional
            Anchor ``x⁰``; default zeros. For a warm start pass the previous ``x_rps``.

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
            self._pass_model(build_lp(problem, x_prev_rps))
        t1 = time.perf_counter()
        self._highs.run()
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
        col = np.asarray(sol.col_value, dtype=np.float64)
        row_dual = np.asarray(sol.row_dual, dtype=np.float64)
        n_a, n_g, n_e = a.n_pairs, a.n_classes, a.n_engines
        x_pairs = a.vectors.x_prev_pairs + col[:n_a] - col[n_a : 2 * n_a]
        shed = col[a.n_cols - n_g :]
        tol = self._tolerance * max(1.0, float(problem.demand_rps.max(initial=0.0)))
        for name, arr in (("x", x_pairs), ("shed", shed)):
            if not np.all(np.isfinite(arr)) or (arr.size and arr.min() < -tol):
                self.reset()
                raise SolveError(
                    "Optimal", f"{name} has non-finite or negative values (min {arr.min():.3g})"
                )
        x_pairs = np.maximum(x_pairs, 0.0)
        shed = np.maximum(shed, 0.0)
        x = np.zeros((n_g, n_e))
        x[a.class_index, a.engine_index] = x_pairs
        info = self._highs.getInfo()
        return SolveResult(
            x_rps=x,
            shed_rps=shed,
            objective=float(info.objective_function_value),
            marginal_cost_s=row_dual[:n_g].copy(),
            load_rps=x.sum(axis=0),
            status="Optimal",
            iterations=int(info.simplex_iteration_count),
            solve_time_s=solve_s,
            build_time_s=build_s,
            warm=warm,
        )
