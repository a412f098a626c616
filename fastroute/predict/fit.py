"""Offline fit of the step-time model to measured points (a batch twin of the online RLS).

The online calibration (:class:`~fastroute.predict.rls.RobustRLS`) folds in one timing at
a time. A calibration run against a real engine has all its points at once, so it fits
them in one solve: **relative** least squares (each row divided by its measured time, so
the fit minimises relative errors, like the RLS: step-time noise is multiplicative) under
``θ ≥ 0`` (every term is a cost, as the RLS projection enforces), by Lawson–Hanson
non-negative least squares on column-scaled features.

Features are the summed step features of :mod:`fastroute.predict.step_time` (8 values,
:data:`~fastroute.predict.step_time.COEF_NAMES` order); a coefficient can be fixed (not
fitted) by listing it in ``fixed``, and a column with no excitation in the data is left
at its ``fixed`` value or 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import numpy as np

from fastroute.predict.step_time import COEF_NAMES

__all__ = ["StepFit", "fit_step_times", "nnls", "relative_errors"]

#: Iteration bound of the NNLS active-set loop (it needs at most a few per column).
NNLS_MAX_ITERATIONS = 200
#: Tolerance on the NNLS dual (gradient) for a column to enter the active set.
NNLS_TOLERANCE = 1e-12


class StepFit(msgspec.Struct, frozen=True):
    """Result of :func:`fit_step_times`.

    Attributes
    ----------
    coef : dict of str to float
        Fitted (or fixed) coefficients by name, seconds.
    fitted : list of str
        The coefficients the data determined (the others were fixed or unexcited).
    rel_err : list of float
        Per point, ``(ŷ − y) / y``.
    p50_abs_rel_err, p90_abs_rel_err, max_abs_rel_err : float
        Percentiles of ``|rel_err|``.
    """

    coef: dict[str, float]
    fitted: list[str]
    rel_err: list[float]
    p50_abs_rel_err: float
    p90_abs_rel_err: float
    max_abs_rel_err: float

    def predict(self, features: Sequence[float]) -> float:
        """Predicted time (s) of the phase whose summed features are ``features``."""
        return float(sum(self.coef[n] * x for n, x in zip(COEF_NAMES, features, strict=True)))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares ``min ‖a·x − b‖ s.t. x ≥ 0`` (Lawson–Hanson active set).

    Parameters
    ----------
    a : ndarray, shape (m, k)
    b : ndarray, shape (m,)

    Returns
    -------
    ndarray, shape (k,)

    Raises
    ------
    RuntimeError
        If the active-set loop has not converged in :data:`NNLS_MAX_ITERATIONS`.
    """
    k = a.shape[1]
    x = np.zeros(k)
    passive = np.zeros(k, dtype=bool)
    for _ in range(NNLS_MAX_ITERATIONS):
        grad = a.T @ (b - a @ x)
        candidates = ~passive & (grad > NNLS_TOLERANCE)
        if not candidates.any():
            return x
        passive[np.argmax(np.where(candidates, grad, -np.inf))] = True
        while True:
            z = np.zeros(k)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back to the boundary and drop the columns that hit zero.
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > NNLS_TOLERANCE
            x[~passive] = 0.0
    raise RuntimeError(f"NNLS did not converge in {NNLS_MAX_ITERATIONS} iterations")


def relative_errors(coef: Sequence[float], features: np.ndarray, times_s: np.ndarray) -> np.ndarray:
    """Per point ``(ŷ − y) / y`` of coefficients ``coef`` (feature order)."""
    return (features @ np.asarray(coef, dtype=float) - times_s) / times_s


def fit_step_times(
    features: Sequence[Sequence[float]],
    times_s: Sequence[float],
    *,
    fixed: Mapping[str, float] | None = None,
) -> StepFit:
    """Fit the step-time coefficients to measured phases by relative NNLS.

    Parameters
    ----------
    features : sequence of sequence of float
        Per point, the 8 summed step features (``prefill_features``, ``decode_features``,
        ``step_features``, ...).
    times_s : sequence of float
        Per point, the measured time (s, > 0).
    fixed : mapping of str to float, optional
        Coefficients held at a given value; their contribution is subtracted first.

    Returns
    -------
    StepFit

    Raises
    ------
    ValueError
        On a shape mismatch, a non-positive time or an unknown coefficient name.
    """
    x = np.asarray(features, dtype=float)
    y = np.asarray(times_s, dtype=float)
    if x.ndim != 2 or x.shape[1] != len(COEF_NAMES) or x.shape[0] != y.shape[0]:
        raise ValueError(f"features must be (n, {len(COEF_NAMES)}) beside n times, got {x.shape}")
    if not (y > 0).all():
        raise ValueError("every time must be positive")
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(COEF_NAMES)
    if unknown:
        raise ValueError(f"unknown coefficients {sorted(unknown)}")
    theta = np.array([fixed.get(n, 0.0) for n in COEF_NAMES])
    free = np.array([n not in fixed and bool(np.any(x[:, j])) for j, n in enumerate(COEF_NAMES)])
    offset = x[:, ~free] @ theta[~free]
    # Relative rows (÷ y) and unit-norm columns (conditioning: the features span 1…1e6).
    rows = x[:, free] / y[:, None]
    scale = np.linalg.norm(rows, axis=0)
    scale[scale == 0.0] = 1.0
    theta[free] = nnls(rows / scale, 1.0 - offset / y) / scale
    err = relative_errors(theta, x, y)
    abs_err = np.abs(err)
    return StepFit(
        coef={n: float(c) for n, c in zip(COEF_NAMES, theta, strict=True)},
        fitted=[n for n, f in zip(COEF_NAMES, free, strict=True) if f],
        rel_err=[float(e) for e in err],
        p50_abs_rel_err=float(np.percentile(abs_err, 50)),
        p90_abs_rel_err=float(np.percentile(abs_err, 90)),
        max_abs_rel_err=float(abs_err.max()),
    )
