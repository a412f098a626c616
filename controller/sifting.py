"""Column generation ("sifting") for large ungrouped routing LPs: same optimum, fewer columns.

Why (docs/controller.md, docs/algorithms.md §1.6): a warm dual-simplex period on an ungrouped
50 × 500 LP takes ~1–2 k pivots (about one per engine whose load sits on a segment breakpoint) and
each pivot's cost grows with the number of pair columns (measured 0.24 ms at 25 k pairs vs 0.06 ms
at 6.6 k). Most pairs never carry traffic (a class rarely uses far regions), so the LP is solved
over a *working set* ``W`` of pairs and the rest are priced out with the duals:

1. ``W`` starts as, per class, the ``pairs_per_class`` pairs cheapest to start using
   (``d_ge + m_e1``: network latency plus the engine's first segment slope), plus the anchor's
   support (so every excluded pair has ``x⁰ = 0`` and only its ``p`` column matters). It persists
   across periods and only grows, so period after period the restricted LP keeps its structure
   and is re-solved warm (:class:`controller.solve.RoutingLP`).
2. Solve the restricted LP; price every excluded eligible pair:
   ``rc_ge = d_ge + κ_ge − π_g − μ_e`` with ``π`` the demand-row and ``μ`` the link-row duals.
3. If some ``rc < −tol``, add the most negative ones (``add_per_class`` per class) to ``W`` and
   re-solve with *primal* simplex from the carried basis (still primal feasible: the new columns
   start at 0; measured 68 pivots where dual simplex took 609); else the restricted optimum is
   optimal for the full LP (every excluded column has a non-negative reduced cost): same
   objective, same duals, exactly.

Bounded: at most ``max_rounds`` pricing rounds; if violations remain the full LP is solved. The
working set restarts from step 1 when it exceeds ``max_working_fraction`` of the pairs.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import numpy.typing as npt

from controller.lp import RoutingProblem
from controller.solve import RoutingLP, SolveError, SolveResult

__all__ = ["SiftingLP"]

BoolArray = npt.NDArray[np.bool_]


def _restricted(problem: RoutingProblem, working: BoolArray) -> RoutingProblem:
    return replace(problem, eligible=working, kappa_s=problem.kappa_matrix_s)


class SiftingLP:
    """A :class:`RoutingLP` over a growing working set of pairs, priced out each solve.

    Parameters
    ----------
    time_limit_s, threads, tolerance
        As :class:`RoutingLP` (the time limit applies to each restricted solve).
    pairs_per_class : int, optional
        Initial working-set size per class; default ``max(16, n_engines // 8)``.
    max_rounds : int
        Pricing rounds before falling back to the full LP.
    price_tolerance_s : float
        A pair enters when its reduced cost is below ``−price_tolerance_s``.
    add_per_class : int
        Most entering pairs per class and round (the most negative reduced costs): duals of a
        too-small working set overprice capacity, and adding every violator would soon make the
        working set the full LP.
    max_working_fraction : float
        When the working set has grown past this fraction of the eligible pairs (demand moving
        around for a long time), it restarts from the initial set plus the anchor's support
        (one cold solve).

    Attributes
    ----------
    working : ndarray of bool or None
        The current working set (classes × engines).
    rounds : int
        Pricing rounds of the last solve (1: the working set was already sufficient).
    """

    def __init__(
        self,
        *,
        time_limit_s: float | None = None,
        threads: int = 1,
        tolerance: float = 1e-7,
        pairs_per_class: int | None = None,
        max_rounds: int = 20,
        price_tolerance_s: float = 1e-9,
        add_per_class: int = 8,
        max_working_fraction: float = 0.6,
    ) -> None:
        if max_rounds < 1 or add_per_class < 1:
            raise ValueError("max_rounds and add_per_class must be >= 1")
        if not 0 < max_working_fraction <= 1:
            raise ValueError("max_working_fraction must be in (0, 1]")
        self.max_working_fraction = max_working_fraction
        self.restarts = 0
        self.add_per_class = add_per_class
        self.lp = RoutingLP(time_limit_s=time_limit_s, threads=threads, tolerance=tolerance)
        self.pairs_per_class = pairs_per_class
        self.max_rounds = max_rounds
        self.price_tolerance_s = price_tolerance_s
        self.working: BoolArray | None = None
        self.rounds = 0

    def reset(self) -> None:
        """Forget the working set and the basis."""
        self.working = None
        self.lp.reset()

    def _initial(self, problem: RoutingProblem) -> BoolArray:
        n_g, n_e = problem.eligible.shape
        k = self.pairs_per_class or max(16, n_e // 8)
        if k >= n_e:
            return problem.eligible.copy()
        start_cost = problem.network_latency_s + problem.slopes_s[:, 0][None, :]
        start_cost = np.where(problem.eligible, start_cost, np.inf)
        nearest = np.argpartition(start_cost, k - 1, axis=1)[:, :k]
        w = np.zeros((n_g, n_e), dtype=bool)
        np.put_along_axis(w, nearest, True, axis=1)
        return w & problem.eligible

    def solve(
        self, problem: RoutingProblem, x_prev_rps: npt.ArrayLike | None = None
    ) -> SolveResult:
        """Solve ``problem`` exactly (module doc); arguments and result as :meth:`RoutingLP.solve`.

        ``iterations``, ``solve_time_s`` and ``build_time_s`` are summed over the rounds; ``warm``
        tells whether the first round was a warm update.
        """
        elig = problem.eligible
        w = self.working
        if w is None or w.shape != elig.shape:
            w = self._initial(problem)
        elif np.count_nonzero(w & elig) > self.max_working_fraction * np.count_nonzero(elig):
            w = self._initial(problem)  # bounded: restart from the cheap pairs (+ support below)
            self.restarts += 1
        w = w & elig
        if x_prev_rps is not None:
            x0 = np.asarray(x_prev_rps, dtype=np.float64)
            if x0.shape != elig.shape:
                raise ValueError(f"x_prev_rps has shape {x0.shape}, expected {elig.shape}")
            w |= (x0 > 0) & elig
        iterations, solve_s, build_s, first_warm = 0, 0.0, 0.0, None
        d_kappa = problem.network_latency_s + problem.kappa_matrix_s
        res: SolveResult | None = None
        for rnd in range(1, self.max_rounds + 2):
            self.rounds = rnd
            full = rnd > self.max_rounds
            if full:
                w = elig.copy()
            res = self.lp.solve(_restricted(problem, w), x_prev_rps, primal=rnd > 1)
            iterations += res.iterations
            solve_s += res.solve_time_s
            build_s += res.build_time_s
            first_warm = res.warm if first_warm is None else first_warm
            if full or res.link_dual_s is None:
                break
            rc = d_kappa - res.marginal_cost_s[:, None] - res.link_dual_s[None, :]
            rc = np.where(elig & ~w, rc, np.inf)
            k = min(self.add_per_class, rc.shape[1])
            best = np.argpartition(rc, k - 1, axis=1)[:, :k]
            enter = np.zeros_like(w)
            np.put_along_axis(enter, best, True, axis=1)
            enter &= rc < -self.price_tolerance_s
            if not enter.any():
                break
            w = w | enter
        if res is None:  # pragma: no cover - the loop runs at least once
            raise SolveError("Unknown", "no sifting round ran")
        self.working = w
        return replace(
            res,
            iterations=iterations,
            solve_time_s=solve_s,
            build_time_s=build_s,
            warm=bool(first_warm),
        )
