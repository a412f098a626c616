"""Reuse the last LP solution when a period's LP inputs equal those of the last solve.

Most control periods at steady load change nothing the LP reads: the demand forecaster holds its
value inside its dead band, health levels and fitted profiles stay put, and once the solution is
at the κ fixed point the anchor (what the published table sends at the forecast) is that same
solution. Re-solving then returns the result of the last solve from its own optimal basis, so the
controller keeps the last result instead (no worker-thread hand-off, no HiGHS run).

:class:`SolveMemo` holds the inputs and result of the last *successful* solve. The inputs are
compared exactly: the LP object and the fleet model by identity (the service replaces the model
whenever groups or profiles change, and a reload replaces both), the demand and anchor arrays
bitwise, the scalars by value. The caller forgets the memo when a solve fails (the LP is reset,
the next solve starts cold). Everything after the solve (shed fractions at the live demand, the
publish decision and the heartbeat) runs every period as before.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["SolveInputs", "SolveMemo"]

T = TypeVar("T")


def _exact(a: npt.NDArray[np.generic] | None, b: npt.NDArray[np.generic] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


class SolveInputs:
    """Everything one period's solve reads.

    Parameters
    ----------
    lp : object
        The LP (``RoutingLP`` or ``SiftingLP``), compared by identity.
    model : object
        The fleet model (groups, profiles, shed weights), compared by identity.
    demand_rps : ndarray
        The forecast the LP plans for (copied).
    anchor_rps : ndarray or None
        The move-cost anchor (copied).
    kappa_s, shed_base_factor : float
    """

    __slots__ = ("lp", "model", "demand_rps", "anchor_rps", "kappa_s", "shed_base_factor")

    def __init__(
        self,
        lp: object,
        model: object,
        demand_rps: npt.NDArray[np.float64],
        anchor_rps: npt.NDArray[np.float64] | None,
        kappa_s: float,
        shed_base_factor: float,
    ) -> None:
        self.lp = lp
        self.model = model
        self.demand_rps = np.array(demand_rps, dtype=np.float64)
        self.anchor_rps = None if anchor_rps is None else np.array(anchor_rps, dtype=np.float64)
        self.kappa_s = float(kappa_s)
        self.shed_base_factor = float(shed_base_factor)

    def same_as(self, other: SolveInputs) -> bool:
        """Whether ``other`` is exactly the same input (see module doc)."""
        return (
            self.lp is other.lp
            and self.model is other.model
            and self.kappa_s == other.kappa_s
            and self.shed_base_factor == other.shed_base_factor
            and _exact(self.demand_rps, other.demand_rps)
            and _exact(self.anchor_rps, other.anchor_rps)
        )


class SolveMemo(Generic[T]):
    """The last successful solve's inputs and result.

    Attributes
    ----------
    reused_total : int
        Lookups answered from the memo.
    """

    def __init__(self) -> None:
        self._inputs: SolveInputs | None = None
        self._result: T | None = None
        self.reused_total = 0

    def get(self, inputs: SolveInputs) -> T | None:
        """The stored result if ``inputs`` equal the stored inputs, else None."""
        if self._inputs is None or not self._inputs.same_as(inputs):
            return None
        self.reused_total += 1
        return self._result

    def put(self, inputs: SolveInputs, result: T) -> None:
        """Remember a successful solve (replaces the previous one)."""
        self._inputs, self._result = inputs, result

    def forget(self) -> None:
        """Drop the memo (after a failed solve, so the next period solves)."""
        self._inputs = self._result = None
