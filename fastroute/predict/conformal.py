"""Split-conformal upper bound on a ratio ``y / ŷ`` over a sliding window.

Method (split conformal prediction; Vovk, Gammerman & Shafer, *Algorithmic Learning
in a Random World*, 2005; Lei et al., JASA 2018)
    Keep the last ``window`` **out-of-sample** ratios ``s_i = y_i / ŷ_i`` (each ``ŷ_i``
    computed *before* the model saw ``y_i``, so the calibration set is never fitted
    on). For coverage ``q`` the bound factor is the ``⌈(m + 1)·q⌉``-th smallest of the
    ``m`` ratios; then ``P[y <= ŷ · factor] >= q`` for a new exchangeable sample. A
    sliding window trades exact exchangeability for tracking drift (the model keeps
    learning, so old ratios go stale). Ratios, not differences, because step-time
    noise is multiplicative.

Cost
    ``add`` is O(1) into a preallocated ring. The factor is recomputed lazily (one
    ``np.partition`` of the window) when asked after at least ``refresh`` new
    samples, and cached otherwise.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ConformalBound"]


class ConformalBound:
    """Sliding-window split-conformal quantile of ``y / ŷ``.

    Parameters
    ----------
    coverage : float
        Target coverage in (0, 1), e.g. 0.9 for a p90 bound.
    window : int
        Ratios kept (the most recent).
    min_samples : int
        Below this many ratios :meth:`factor` returns ``default_factor``.
    default_factor : float
        Factor before enough data (a deliberately loose guess).
    refresh : int
        Recompute the quantile after this many new ratios at most.
    """

    def __init__(
        self,
        coverage: float = 0.9,
        *,
        window: int = 512,
        min_samples: int = 20,
        default_factor: float = 1.5,
        refresh: int = 16,
    ) -> None:
        if not 0.0 < coverage < 1.0:
            raise ValueError(f"coverage must be in (0, 1), got {coverage}")
        if window < 2 or min_samples < 1 or refresh < 1:
            raise ValueError("window must be >= 2, min_samples and refresh >= 1")
        self.coverage = float(coverage)
        self.window = int(window)
        self.min_samples = int(min_samples)
        self.default_factor = float(default_factor)
        self.refresh = int(refresh)
        self._ring = np.empty(self.window)
        self._work = np.empty(self.window)
        self._pos = 0
        self._count = 0
        self._stale = 0
        self._factor = self.default_factor
        self._fresh = False  # _factor computed from data at least once

    @property
    def count(self) -> int:
        """Ratios currently in the window."""
        return self._count

    def add(self, y: float, y_hat: float) -> None:
        """Record one out-of-sample pair (ignored unless both are positive and finite)."""
        if not (y_hat > 0.0 and y >= 0.0 and math.isfinite(y) and math.isfinite(y_hat)):
            return
        self._ring[self._pos] = y / y_hat
        self._pos = (self._pos + 1) % self.window
        if self._count < self.window:
            self._count += 1
        self._stale += 1

    def factor(self) -> float:
        """The bound factor: ``ŷ · factor()`` is the upper ``coverage`` bound."""
        if self._count < self.min_samples:
            return self.default_factor
        if self._stale >= self.refresh or not self._fresh:
            m = self._count
            rank = min(m, math.ceil((m + 1) * self.coverage)) - 1
            work = self._work[:m]
            np.copyto(work, self._ring[:m])
            work.partition(rank)
            self._factor = float(work[rank])
            self._stale = 0
            self._fresh = True
        return self._factor

    def reset(self) -> None:
        """Forget every ratio."""
        self._pos = self._count = self._stale = 0
        self._factor = self.default_factor
        self._fresh = False
