"""The old proportional (P) controller, kept only as a baseline to measure the optimiser against.

docs/algorithms.md §8.1 (docs/design.md §1A.5): every period each engine's weight is nudged by its
latency relative to the fleet average,

    w_e ← w_e · (1 − K · (ŝ_e − s̄) / s̄),

where ŝ_e is the EWMA (factor ``a``) of engine ``e``'s latency as observed ``D`` periods late and
``s̄`` is the unweighted mean of the ŝ_e; weights are then clamped to ``min_weight`` and
renormalised to sum to 1. Linearised around the equilibrium of M/M/1-like engines the loop gain is
``G ≈ K·ρ/(1−ρ)`` (:func:`loop_gain`); without smoothing the loop is stable iff
``0 < G < 2 sin(π / (2(2D+1)))`` (:func:`critical_gain`); smoothing lowers the bound further
(:func:`critical_gain` with ``ewma_alpha < 1``, :func:`spectral_radius`).

Nothing in the service uses this module: it exists to reproduce the oscillation of §8.2 in tests
and benchmarks (churn per period with :func:`controller.weights.churn`, :func:`weight_amplitude`).
Pure and deterministic: no clock, no randomness, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

__all__ = [
    "ProportionalController",
    "critical_gain",
    "loop_gain",
    "spectral_radius",
    "weight_amplitude",
]

FloatArray = npt.NDArray[np.float64]


class ProportionalController:
    """Multiplicative latency-equalising weight controller (the §8.1 baseline).

    Parameters
    ----------
    gain : float
        ``K`` > 0, the proportional gain.
    ewma_alpha : float
        ``a`` ∈ (0, 1], the EWMA factor of the latency estimate (1 = no smoothing).
    delay_periods : int
        ``D`` ≥ 0: the latency measured in period ``t`` is used in period ``t + D``.
    min_weight : float
        Floor applied before renormalising, ∈ [0, 1/n_engines).
    engines : sequence of str, optional
        Engine order. Default: the keys of the first :meth:`step` call, in insertion order.
    initial_weights : mapping of str to float, optional
        Starting weights (normalised); default equal. Requires ``engines`` or fixes it.

    Notes
    -----
    During the first ``D`` steps the delay line is filling and the weights are held. The EWMA
    starts at the first delayed observation. ``step`` never reads a clock: ``now`` is only
    recorded (``last_step_s``) and checked to be non-decreasing.
    """

    def __init__(
        self,
        gain: float,
        ewma_alpha: float = 1.0,
        delay_periods: int = 0,
        min_weight: float = 1e-3,
        *,
        engines: Sequence[str] | None = None,
        initial_weights: Mapping[str, float] | None = None,
    ) -> None:
        if not gain > 0 or not math.isfinite(gain):
            raise ValueError(f"gain must be finite and > 0, got {gain!r}")
        if not 0 < ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha!r}")
        if int(delay_periods) != delay_periods or delay_periods < 0:
            raise ValueError(f"delay_periods must be an integer >= 0, got {delay_periods!r}")
        if not 0 <= min_weight < 1:
            raise ValueError(f"min_weight must be in [0, 1), got {min_weight!r}")
        self.gain = float(gain)
        self.ewma_alpha = float(ewma_alpha)
        self.delay_periods = int(delay_periods)
        self.min_weight = float(min_weight)
        self.engines: tuple[str, ...] | None = None
        self.weights: FloatArray = np.zeros(0)
        self.estimate_s: FloatArray | None = None
        self.last_step_s: float | None = None
        self.steps = 0
        self._delay: deque[FloatArray] = deque()
        if initial_weights is not None and engines is None:
            engines = list(initial_weights)
        if engines is not None:
            self._init_engines(tuple(engines), initial_weights)

    def _init_engines(
        self, engines: tuple[str, ...], initial: Mapping[str, float] | None = None
    ) -> None:
        n = len(engines)
        if n == 0 or len(set(engines)) != n:
            raise ValueError("engines must be non-empty and distinct")
        if self.min_weight * n >= 1:
            raise ValueError(f"min_weight {self.min_weight} too large for {n} engines")
        if initial is None:
            w = np.full(n, 1.0 / n)
        else:
            if set(initial) != set(engines):
                raise ValueError("initial_weights must name exactly the engines")
            w = np.array([float(initial[e]) for e in engines])
            if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
                raise ValueError("initial_weights must be finite, >= 0 and not all zero")
            w = w / w.sum()
        self.engines = engines
        self.weights = w

    def weights_by_engine(self) -> dict[str, float]:
        """The current weights, keyed by engine (empty before the engines are known)."""
        return dict(zip(self.engines or (), self.weights.tolist(), strict=True))

    def step(self, latency_s_by_engine: Mapping[str, float], now: float) -> dict[str, float]:
        """Close one period: feed this period's measured latencies, return the new weights.

        Parameters
        ----------
        latency_s_by_engine : mapping of str to float
            Latency (s, > 0) measured per engine during the period that just ended, under the
            current weights; exactly the controller's engines.
        now : float
            Time of the step (recorded only; must not decrease).

        Returns
        -------
        dict of str to float
            Weights for the next period, summing to 1, each ≥ ``min_weight`` before renormalising.
        """
        if self.last_step_s is not None and now < self.last_step_s:
            raise ValueError(f"time went backwards: {now} < {self.last_step_s}")
        if self.engines is None:
            self._init_engines(tuple(latency_s_by_engine))
        engines = self.engines
        assert engines is not None
        if len(latency_s_by_engine) != len(engines) or set(latency_s_by_engine) != set(engines):
            raise ValueError("latencies must name exactly the controller's engines")
        lat = np.array([float(latency_s_by_engine[e]) for e in engines])
        if not np.all(np.isfinite(lat)) or np.any(lat <= 0):
            raise ValueError("latencies must be finite and > 0")
        self.last_step_s = float(now)
        self.steps += 1
        self._delay.append(lat)
        if len(self._delay) <= self.delay_periods:
            return self.weights_by_engine()
        observed = self._delay.popleft()
        if self.estimate_s is None:
            self.estimate_s = observed.copy()
        else:
            a = self.ewma_alpha
            self.estimate_s = (1.0 - a) * self.estimate_s + a * observed
        s = self.estimate_s
        mean = float(s.mean())
        w = self.weights * (1.0 - self.gain * (s - mean) / mean)
        w = np.maximum(w, self.min_weight)
        self.weights = w / w.sum()
        return self.weights_by_engine()


def loop_gain(gain: float, rho: float) -> float:
    """Linearised loop gain ``G ≈ K·ρ/(1−ρ)`` of the P-controller on M/M/1-like engines.

    Parameters
    ----------
    gain : float
        ``K``.
    rho : float
        Utilisation at equilibrium, in [0, 1).

    Returns
    -------
    float
        ``K · ∂ln L/∂ln w`` (×3 at 75 % load, ×9 at 90 %).
    """
    if not 0 <= rho < 1:
        raise ValueError(f"rho must be in [0, 1), got {rho!r}")
    return gain * rho / (1.0 - rho)


def spectral_radius(loop: float, delay_periods: int, ewma_alpha: float = 1.0) -> float:
    """Largest root modulus of the linearised loop; < 1 means stable.

    The loop ``x_{t+1} = x_t − G·s_{t−D}``, ``s_t = (1−a)s_{t−1} + a·x_t`` has the characteristic
    polynomial ``(z − 1)(z − (1 − a)) z^D + G·a·z`` (for ``a = 1``: ``z·(z^{D+1} − z^D + G)``).

    Parameters
    ----------
    loop : float
        Loop gain ``G``.
    delay_periods : int
        ``D`` ≥ 0.
    ewma_alpha : float
        ``a`` ∈ (0, 1].

    Returns
    -------
    float
    """
    d = int(delay_periods)
    a = float(ewma_alpha)
    # (z^2 − (2 − a) z + (1 − a)) · z^D + G a z, highest degree first
    coeffs = np.zeros(d + 3)
    coeffs[:3] = [1.0, -(2.0 - a), 1.0 - a]
    coeffs[-2] += loop * a
    return float(np.abs(np.roots(coeffs)).max())


def critical_gain(delay_periods: int, ewma_alpha: float = 1.0) -> float:
    """The largest stable loop gain ``G`` for delay ``D`` (and EWMA factor ``a``).

    Without smoothing (``a = 1``) the closed form ``2 sin(π / (2(2D+1)))`` (2, 1, 0.618, 0.445,
    0.285, 0.149 for D = 0, 1, 2, 3, 5, 10). With ``a < 1``, bisection on
    :func:`spectral_radius` (the measured columns of docs/algorithms.md §8.1, e.g. D = 2, a = 0.3 →
    0.537), to about 1e-9 relative.

    Parameters
    ----------
    delay_periods : int
        ``D`` ≥ 0.
    ewma_alpha : float
        ``a`` ∈ (0, 1].

    Returns
    -------
    float
    """
    d = int(delay_periods)
    if d < 0 or d != delay_periods:
        raise ValueError(f"delay_periods must be an integer >= 0, got {delay_periods!r}")
    if not 0 < ewma_alpha <= 1:
        raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha!r}")
    if ewma_alpha == 1.0:
        return 2.0 * math.sin(math.pi / (2 * (2 * d + 1)))
    lo, hi = 0.0, 2.0
    while spectral_radius(hi, d, ewma_alpha) < 1.0:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        if spectral_radius(mid, d, ewma_alpha) < 1.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def weight_amplitude(weights_history: npt.ArrayLike) -> float:
    """Per-engine weight amplitude (max − min over the window), the largest over engines.

    Parameters
    ----------
    weights_history : array_like, shape (n_periods, n_engines)

    Returns
    -------
    float
        0 for fewer than two periods.
    """
    w = np.asarray(weights_history, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"weights_history must be 2-D, got shape {w.shape}")
    if w.shape[0] < 2:
        return 0.0
    return float((w.max(axis=0) - w.min(axis=0)).max())
