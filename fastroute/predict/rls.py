"""Recursive least squares with forgetting, relative (multiplicative-noise) weighting,
Huber-robust sample weights and stabilised forgetting, in information form.

Model
    ``y = θ · x + offset + noise`` with noise roughly proportional to ``y`` (step times:
    a few percent of lognormal jitter, docs/algorithms.md §6.3). ``offset`` is a
    known part of ``y`` (predicted by coefficients the sample must not change). Each
    sample is divided by the current prediction ``ŷ`` (floored), so the fit minimises
    the **relative** squared error and small and large steps count alike; otherwise the
    longest prefills would own the fit and the intercept (weight streaming, ~30 ms)
    would be poorly determined.

Update (weighted least squares with exponential forgetting ``λ``, kept as the
information matrix ``R`` and vector ``b``; Ljung & Söderström, *Theory and Practice of
Recursive Identification*, 1983; stabilised forgetting after Kulhavý & Zarrop, Int. J.
Control 1993)::

    e   = (y − ŷ) / max(ŷ, floor)                           relative residual (out of sample)
    h   = 1 if |e| <= k·σ̂ else k·σ̂ / |e|                     Huber weight (1 during warm-up)
    x'  = x / max(ŷ, floor),  y' = (y − offset) / max(ŷ, floor)
    R   = λ R + (1 − λ) R_floor + h x' x'ᵀ
    b   = λ b + (1 − λ) R_floor θ + h x' y'
    θ   = max(solve(R, b), θ_min)                            projection: costs are >= 0
    σ̂  += β · (1.2533·min(|e|, 4σ̂) − σ̂)                      robust scale (mean |e| of a normal)

``λ = 0.995`` forgets with a time constant of 200 samples, so a drift is tracked within
a few hundred samples. A spike (a ×3 step time, |e| ≈ 2) gets weight ``k·σ̂/2 ≈ 0.06``
instead of 1, so spikes no longer bias the intercept (docs/algorithms.md §6.3;
``tests/unit/predict/test_predict_rls.py::test_huber_weights_resist_spikes``).

Why this form
    A closed-loop run (router and emulated engines) broke the textbook covariance-form
    update: noise-free, collinear data (a steady batch size makes ``B`` and ``S`` move
    together) made ``P`` lose positive definiteness through cancellation, and the
    coefficients then blew up. Here ``R`` is a sum of positive semi-definite terms by
    construction and ``θ`` comes from a 7×7 solve. With plain forgetting, directions no
    sample excites lose all information (``R → 0``, "wind-up") and the next sample in
    such a direction swings ``θ`` wildly; the ``(1 − λ) R_floor`` term keeps at least
    ``R_floor`` of information, anchored at the **current** estimate (no pull back to a
    possibly wrong nominal), i.e. a coefficient's relative uncertainty never grows past
    about ``cap_rel`` (30 %) once learned. Initially ``R`` is the weak prior
    (``prior_rel`` = 100 %), so a far-off nominal is corrected within tens of samples.
    The projection keeps the fit from trading a negative ``b1`` against a larger ``b0``.

Cost
    One 7×7 solve and a few O(d²) numpy operations into preallocated buffers per update
    (about 10-20 µs); :meth:`predict_list` is a pure-Python dot product over a cached
    list of floats, with no array allocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["RobustRLS"]

#: Scale of a normal variable's mean absolute deviation: E|Z| = σ·sqrt(2/π).
_MAD_TO_STD = math.sqrt(math.pi / 2.0)


class RobustRLS:
    """Exponentially weighted, Huber-robust, stabilised RLS on the relative error.

    Parameters
    ----------
    theta0 : sequence of float
        Prior coefficients (raw units, e.g. seconds per token).
    feature_scale : sequence of float
        Per-feature multipliers applied before fitting (for conditioning only; the
        fit is invariant to them in exact arithmetic). Same length as ``theta0``.
    prior_rel : float
        Relative standard deviation of the prior on each coefficient (1.0: the prior
        may be off by about its own size).
    noise_rel : float
        Nominal relative noise of a sample; with ``prior_rel`` it sets how many
        samples outweigh the prior.
    forgetting : float
        ``λ`` in (0, 1]; 1 = no forgetting.
    huber_k : float
        Huber threshold in units of the robust scale ``σ̂``.
    warmup : int
        Samples during which every weight is 1 (the prior may be far off, so large
        residuals are expected, not outliers).
    floor : float
        Floor on ``ŷ`` used as the divisor (raw output units).
    min_coef : sequence of float, optional
        Lower bounds on the raw coefficients (default 0: every step-time term is a
        cost). The estimate is projected onto them after every update.
    cap_rel : float
        Stabilised forgetting: the relative standard deviation a learned coefficient
        may drift back to when no sample excites it (relative to ``noise_rel``).
    """

    def __init__(
        self,
        theta0: Sequence[float],
        feature_scale: Sequence[float],
        *,
        prior_rel: float = 1.0,
        noise_rel: float = 0.05,
        forgetting: float = 0.995,
        huber_k: float = 2.5,
        warmup: int = 30,
        floor: float = 1e-4,
        min_coef: Sequence[float] | None = None,
        cap_rel: float = 0.3,
    ) -> None:
        d = len(theta0)
        if d == 0 or len(feature_scale) != d:
            raise ValueError("theta0 and feature_scale must be non-empty and of equal length")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if min(prior_rel, noise_rel, huber_k, floor, cap_rel) <= 0:
            raise ValueError("prior_rel, noise_rel, huber_k, floor and cap_rel must be > 0")
        self.dim = d
        self.forgetting = float(forgetting)
        self.huber_k = float(huber_k)
        self.warmup = int(warmup)
        self.floor = float(floor)
        self.scale = np.asarray(feature_scale, dtype=np.float64).copy()
        if np.any(self.scale <= 0):
            raise ValueError("feature_scale must be > 0")
        self.theta = np.asarray(theta0, dtype=np.float64) / self.scale  # scaled units
        self._theta0 = self.theta.copy()
        spread = np.maximum(np.abs(self.theta), 1e-3 * np.abs(self.theta).max() + 1e-12)
        # Information of the prior and the stabilising floor, in units where the relative
        # noise is 1 (diagonal).
        self._r0 = (noise_rel / (prior_rel * spread)) ** 2
        self._r_floor = (1.0 - self.forgetting) * (noise_rel / (cap_rel * spread)) ** 2
        self.R = np.diag(self._r0)
        self.b = self._r0 * self.theta
        self._min = np.zeros(d) if min_coef is None else np.asarray(min_coef, dtype=np.float64)
        self._min_scaled = self._min / self.scale
        self.sigma = 0.1  # robust relative scale σ̂, before any data
        self.n_samples = 0
        self.weight_sum = 0.0  # Σ Huber weights: effective samples (outliers count less)
        self.abs_rel_err = 0.0  # EWMA of |e| (unclipped), for monitoring
        # Preallocated buffers: no array is created per update except inside solve().
        self._x = np.empty(d)
        self._outer = np.empty((d, d))
        self._diag_idx = np.arange(d)
        #: Current raw coefficients: a plain list, replaced (never mutated) after each
        #: update, so readers may keep a reference. Do not modify.
        self.coef: list[float] = []
        self._refresh()

    # -- prediction ------------------------------------------------------------------------

    def predict_list(self, x: Sequence[float]) -> float:
        """``θ · x`` for raw features ``x`` (pure Python; the hot-path form)."""
        s = 0.0
        for c, v in zip(self.coef, x, strict=False):
            s += c * v
        return s

    # -- calibration -----------------------------------------------------------------------

    def update(self, x: Sequence[float], y: float, offset: float = 0.0) -> float:
        """Fold in one sample: raw features ``x``, observed ``y``.

        ``offset`` is a known part of ``y`` (predicted by coefficients this sample must
        not change; their features are zero in ``x``): the model is
        ``y = θ·x + offset``, and the relative error is over the whole ``y``.

        Returns
        -------
        float
            The relative residual ``(y − ŷ) / ŷ`` *before* the update (out of sample).

        Raises
        ------
        ValueError
            ``y`` or ``offset`` is not finite, or ``x`` has the wrong length.
        """
        if not (math.isfinite(y) and math.isfinite(offset)):
            raise ValueError(f"observation must be finite, got {y} (offset {offset})")
        if len(x) != self.dim:
            raise ValueError(f"expected {self.dim} features, got {len(x)}")
        xs = self._x
        xs[:] = x
        xs *= self.scale
        y_hat = float(self.theta @ xs) + offset
        denom = max(y_hat, self.floor)
        e = (y - y_hat) / denom
        abs_e = abs(e)
        if self.n_samples < self.warmup or abs_e <= self.huber_k * self.sigma:
            h = 1.0
        else:
            h = self.huber_k * self.sigma / abs_e
        xs /= denom
        lam = self.forgetting
        R, b = self.R, self.b
        R *= lam
        R[self._diag_idx, self._diag_idx] += self._r_floor
        np.outer(xs, xs, out=self._outer)
        self._outer *= h
        R += self._outer
        b *= lam
        b += self._r_floor * self.theta
        b += (h * (y - offset) / denom) * xs
        self.theta = np.linalg.solve(R, b)
        np.maximum(self.theta, self._min_scaled, out=self.theta)
        clipped = min(abs_e, 4.0 * self.sigma) if self.n_samples >= self.warmup else abs_e
        self.sigma = max(1e-3, self.sigma + 0.05 * (_MAD_TO_STD * clipped - self.sigma))
        self.abs_rel_err += 0.02 * (abs_e - self.abs_rel_err) if self.n_samples else abs_e
        self.n_samples += 1
        self.weight_sum += h
        self._refresh()
        return e

    def reset(self) -> None:
        """Back to the prior."""
        self.theta = self._theta0.copy()
        self.R[:] = np.diag(self._r0)
        self.b[:] = self._r0 * self.theta
        self.sigma = 0.1
        self.n_samples = 0
        self.weight_sum = 0.0
        self.abs_rel_err = 0.0
        self._refresh()

    def information(self) -> list[list[float]]:
        """The information matrix ``R`` in internal scaled units (for :meth:`load`)."""
        return self.R.tolist()

    def load(
        self,
        coef: Sequence[float],
        n_samples: int,
        sigma: float,
        information: Sequence[Sequence[float]] | None = None,
    ) -> None:
        """Start from published coefficients (raw units) instead of the prior.

        With the publisher's ``information`` (:meth:`information`) the state is exactly
        theirs; without it ``R`` is the prior's scaled as if ``min(n_samples, 1/(1-λ))``
        samples had been seen, so the first local samples do not overwrite it.
        """
        if len(coef) != self.dim:
            raise ValueError(f"expected {self.dim} coefficients, got {len(coef)}")
        theta = np.asarray(coef, dtype=np.float64) / self.scale
        if information is not None and len(information):
            info = np.asarray(information, dtype=np.float64)
            if info.shape != (self.dim, self.dim) or not np.all(np.isfinite(info)):
                raise ValueError(f"information must be a finite {self.dim}x{self.dim} matrix")
            self.R[:] = info
        else:
            window = 1.0 / (1.0 - self.forgetting) if self.forgetting < 1.0 else float(n_samples)
            seen = max(1.0, min(float(n_samples), window))
            self.R[:] = np.diag(self._r0 * seen)
        self.theta = np.maximum(theta, self._min_scaled)
        self.b[:] = self.R @ self.theta
        self.sigma = max(1e-3, float(sigma))
        self.n_samples = int(n_samples)
        self._refresh()

    # -- internals -------------------------------------------------------------------------

    def _refresh(self) -> None:
        self.coef = (self.theta * self.scale).tolist()
