"""``--mode p-controller``: the legacy proportional controller run as the service's policy.

For experiments and comparison with the LP (docs/algorithms.md §8): every period each class
row is one :class:`controller.pcontroller.ProportionalController` over the engines eligible for the
class, fed the engines' observed per-request latency of the window just closed
(``L = TTFT + γ · E[N_out] · TBOT``, :func:`window_latency_s`). The weights are published exactly
like the LP's (same table, same validation); shed fractions are 0 (the baseline never sheds).

Engines without latency samples in the window keep their last observed latency; engines never
observed get the mean of the class's observed engines (no nudge). A class with no observation at
all holds its weights. Engines derated to 0 (unavailable) are dropped from the published row and
the row renormalised; the controller's own state keeps them, as the legacy system did.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from controller.health import HealthWindow
from controller.latency import LatencyProfile
from controller.pcontroller import ProportionalController

__all__ = ["BaselinePolicy", "window_latency_s"]

FloatArray = npt.NDArray[np.float64]


def window_latency_s(window: HealthWindow, profiles: Sequence[LatencyProfile]) -> FloatArray:
    """Mean per-request latency per engine in ``window`` (NaN where there is no TTFT sample).

    ``L = mean TTFT + γ · E[N_out] · mean TBOT`` with ``γ`` and ``E[N_out]`` of the engine's
    profile; the TBOT term is left out where the window has no TBOT sample (non-streamed traffic).
    """
    n = window.ttft_count.size
    ttft = np.divide(
        window.ttft_sum_s, window.ttft_count, out=np.full(n, np.nan), where=window.ttft_count > 0
    )
    tbot = np.divide(
        window.tbot_sum_s, window.tbot_count, out=np.zeros(n), where=window.tbot_count > 0
    )
    decode = np.array([p.gamma * p.mean_output_tokens for p in profiles], dtype=np.float64)
    return np.asarray(ttft + decode * tbot, dtype=np.float64)


class BaselinePolicy:
    """Per-class proportional controllers producing a full weight table.

    Parameters
    ----------
    eligible : array_like of bool, shape (n_classes, n_engines)
    engine_names : sequence of str, length n_engines
    gain, ewma_alpha, delay_periods, min_weight
        See :class:`ProportionalController`.
    """

    def __init__(
        self,
        eligible: npt.ArrayLike,
        engine_names: Sequence[str],
        *,
        gain: float = 0.5,
        ewma_alpha: float = 0.5,
        delay_periods: int = 0,
        min_weight: float = 1e-3,
    ) -> None:
        self.eligible = np.asarray(eligible, dtype=bool)
        self.engine_names = tuple(engine_names)
        if self.eligible.ndim != 2 or self.eligible.shape[1] != len(self.engine_names):
            raise ValueError("eligible must be (n_classes, n_engines) with one name per engine")
        self.columns = [np.flatnonzero(row) for row in self.eligible]
        self.controllers: list[ProportionalController | None] = []
        for cols in self.columns:
            if cols.size == 0:
                self.controllers.append(None)
                continue
            floor = min(min_weight, 0.5 / cols.size)
            self.controllers.append(
                ProportionalController(
                    gain,
                    ewma_alpha,
                    delay_periods,
                    floor,
                    engines=[self.engine_names[i] for i in cols],
                )
            )
        self.last_latency_s = np.full(len(self.engine_names), np.nan)

    def weights(self, available: npt.ArrayLike | None = None) -> FloatArray:
        """The current table ``(n_classes, n_engines)``; unavailable engines dropped."""
        n_g, n_e = self.eligible.shape
        w = np.zeros((n_g, n_e))
        for g, (cols, ctl) in enumerate(zip(self.columns, self.controllers, strict=True)):
            if ctl is not None:
                w[g, cols] = ctl.weights
        if available is not None:
            w *= np.asarray(available, dtype=bool)[None, :]
        total = w.sum(axis=1, keepdims=True)
        return np.divide(w, total, out=np.zeros_like(w), where=total > 0)

    def step(
        self, latency_s: npt.ArrayLike, now_s: float, available: npt.ArrayLike | None = None
    ) -> FloatArray:
        """Close one period with the engines' observed latency (NaN: no sample); new weights.

        Parameters
        ----------
        latency_s : array_like, shape (n_engines,)
            This window's mean per-request latency (s) per engine, NaN where unobserved.
        now_s : float
            Time of the step (non-decreasing).
        available : array_like of bool, shape (n_engines,), optional
            Engines that may get traffic; default all.
        """
        lat = np.asarray(latency_s, dtype=np.float64)
        if lat.shape != (len(self.engine_names),):
            raise ValueError(f"latency_s must have shape ({len(self.engine_names)},)")
        fresh = np.isfinite(lat) & (lat > 0)
        self.last_latency_s[fresh] = lat[fresh]
        known = self.last_latency_s
        for cols, ctl in zip(self.columns, self.controllers, strict=True):
            if ctl is None:
                continue
            row = known[cols]
            seen = np.isfinite(row)
            if not seen.any():
                continue
            row = np.where(seen, row, float(row[seen].mean()))
            ctl.step(dict(zip(ctl.engines or (), row.tolist(), strict=True)), now_s)
        return self.weights(available)
