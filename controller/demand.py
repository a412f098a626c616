"""Per-class demand forecast from data-plane reports.

Every proxy worker posts a :class:`fastroute.signals.reports.Report` about once a second: per class
key the number of requests classified in its window (shed ones included, so the count is the
offered demand, not the served one). The forecaster turns those into one rate per class for each
control period:

1. **Per worker** (``worker_id``), requests and covered window seconds accumulate between two
   :meth:`DemandForecaster.update` calls; at the update the worker's rate per class is
   ``requests / covered seconds``. A worker that sent nothing since the last update keeps its last
   rates. A worker not heard from for ``stale_periods`` periods is forgotten (its reports no
   longer count); receive times use the controller's clock, so proxy clock skew does not matter.
2. **Per class** the measured rate is the sum over the live workers. Only classes whose source
   cluster has at least one live worker are measured in a period; the others keep their previous
   forecast (or the caller's default before any measurement).
3. **Forecast** = ``max(EWMA, recent peak)``: ``EWMA ← α·measured + (1 − α)·EWMA`` (initialised
   to the first measurement) and the peak is the largest measured rate of the last
   ``peak_periods`` periods, so a rise is followed at once and a fall only after the peak window,
   then smoothly. A per-class floor keeps the forecast above 0 while the class has engines, so its
   weight row never goes empty.
4. **Dead band**: the forecast handed to the planner is *held* until that candidate differs from
   it by more than ``deadband_z`` standard errors of the period's measurement. The counts are
   Poisson, so a measured rate ``N / T`` has standard error ``√N / T`` (summed in variance over
   the workers); with ~150 requests per period that is ±8 %, and ``max(EWMA, peak)`` moves by
   that much every period on noise alone. Every forecast move re-splits the marginal traffic in
   the LP (weight churn, sessions losing their cache), so only a move that noise is unlikely to
   explain is passed on. A step of more than ``deadband_z`` standard errors passes at the next
   update (the peak term jumps to it); a smaller drift passes once ``max(EWMA, peak)`` has moved
   that far from the held value, so the held forecast is never further than ``deadband_z``
   standard errors from it.
5. **Level**: what needs the demand level itself (shed fractions) reads the EWMA alone,
   :meth:`DemandForecaster.level`. The peak term biases the forecast up (of 3 periods of ~10
   Poisson requests, by ~27 %); provisioning for that is cheap, shedding for it is not: at 90 %
   offered load ``max(EWMA, peak)`` shed 15.9 % of requests, the EWMA 2.4 %
   (``bench/shed_estimator_noise.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from fastroute.signals.reports import Report

__all__ = ["DemandForecaster", "carry_forecast"]

FloatArray = npt.NDArray[np.float64]


@dataclass
class _Worker:
    cluster: str
    last_seen_s: float
    pending_window_s: float = 0.0
    pending_requests: dict[int, int] = field(default_factory=dict)
    rates_rps: dict[int, float] = field(default_factory=dict)
    # Poisson variance of each rate, count / window² ((req/s)²)
    variances_rps2: dict[int, float] = field(default_factory=dict)


class DemandForecaster:
    """EWMA + recent-peak demand per class key, fed by proxy reports.

    Parameters
    ----------
    class_keys : sequence of int
        The class row keys, in table row order.
    class_clusters : sequence of str
        Source cluster of each class (same order).
    period_s : float
        Control period (s); staleness is measured in periods.
    alpha : float
        EWMA weight of the newest measurement, in (0, 1].
    peak_periods : int
        Periods over which the recent peak is taken (≥ 1).
    stale_periods : float
        A worker silent for longer than ``stale_periods · period_s`` is forgotten.
    deadband_z : float
        Hold the forecast until ``max(EWMA, peak)`` moves by more than this many Poisson standard
        errors of the period's measured rate (≥ 0; 0 passes every move on).

    Attributes
    ----------
    unknown_keys_total : int
        Class observations in reports whose key is not one of ``class_keys`` (ignored).
    """

    def __init__(
        self,
        class_keys: Sequence[int],
        class_clusters: Sequence[str],
        *,
        period_s: float,
        alpha: float = 0.3,
        peak_periods: int = 3,
        stale_periods: float = 3.0,
        deadband_z: float = 2.0,
    ) -> None:
        if len(class_keys) != len(class_clusters):
            raise ValueError("class_keys and class_clusters must have the same length")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if peak_periods < 1 or not period_s > 0 or not stale_periods > 0:
            raise ValueError("peak_periods must be >= 1, period_s and stale_periods > 0")
        if not deadband_z >= 0.0:
            raise ValueError(f"deadband_z must be >= 0, got {deadband_z}")
        self.class_keys = [int(k) for k in class_keys]
        self.class_clusters = list(class_clusters)
        self._row = {k: i for i, k in enumerate(self.class_keys)}
        if len(self._row) != len(self.class_keys):
            raise ValueError("class_keys must be unique")
        self.period_s = float(period_s)
        self.alpha = float(alpha)
        self.stale_after_s = float(stale_periods) * self.period_s
        self.deadband_z = float(deadband_z)
        n = len(self.class_keys)
        self._ewma_rps = np.zeros(n)
        self._held_rps = np.zeros(n)
        self._measured = np.zeros(n, dtype=bool)
        self._peaks: deque[FloatArray] = deque(maxlen=int(peak_periods))
        self._workers: dict[str, _Worker] = {}
        self.last_measured_rps = np.zeros(n)
        self.last_stderr_rps = np.zeros(n)
        self.unknown_keys_total = 0

    # -- input ----------------------------------------------------------------------------------

    def observe(self, report: Report, received_at_s: float) -> None:
        """Add one report (received at ``received_at_s``, controller clock, seconds)."""
        w = self._workers.get(report.worker_id)
        if w is None or w.cluster != report.source_cluster:
            w = _Worker(cluster=report.source_cluster, last_seen_s=received_at_s)
            self._workers[report.worker_id] = w
        w.last_seen_s = max(w.last_seen_s, received_at_s)
        w.pending_window_s += max(0.0, report.window_s)
        for c in report.classes:
            if c.class_key not in self._row:
                self.unknown_keys_total += 1
                continue
            w.pending_requests[c.class_key] = w.pending_requests.get(c.class_key, 0) + c.requests

    # -- per period -----------------------------------------------------------------------------

    @property
    def live_workers(self) -> int:
        """Workers whose reports currently count."""
        return len(self._workers)

    @property
    def measured(self) -> npt.NDArray[np.bool_]:
        """Which classes have had at least one measurement (copy)."""
        return self._measured.copy()

    def update(self, now_s: float) -> None:
        """Close a period: drop stale workers, turn pending counts into rates, update the EWMA and
        the held forecast."""
        for wid in [
            wid for wid, w in self._workers.items() if now_s - w.last_seen_s > self.stale_after_s
        ]:
            del self._workers[wid]
        n = len(self.class_keys)
        measured = np.zeros(n)
        variance = np.zeros(n)
        for w in self._workers.values():
            if w.pending_window_s > 0:
                t = w.pending_window_s
                w.rates_rps = {k: r / t for k, r in w.pending_requests.items()}
                # at least one count's worth, so a silent class still has a dead band
                w.variances_rps2 = {k: max(r, 1) / t**2 for k, r in w.pending_requests.items()}
                w.pending_window_s = 0.0
                w.pending_requests = {}
            for k, rate in w.rates_rps.items():
                measured[self._row[k]] += rate
                variance[self._row[k]] += w.variances_rps2.get(k, 0.0)
        live_clusters = {w.cluster for w in self._workers.values()}
        mask = np.array([c in live_clusters for c in self.class_clusters], dtype=bool)
        if not mask.any():
            return
        first = mask & ~self._measured
        self._ewma_rps[first] = measured[first]
        again = mask & ~first
        self._ewma_rps[again] = (
            self.alpha * measured[again] + (1.0 - self.alpha) * self._ewma_rps[again]
        )
        self._measured |= mask
        peak = np.where(mask, measured, np.nan)
        self._peaks.append(peak)
        self.last_measured_rps = np.where(mask, measured, self.last_measured_rps)
        stderr = np.sqrt(variance)
        self.last_stderr_rps = np.where(mask, stderr, self.last_stderr_rps)
        candidate = np.maximum(self._ewma_rps, self._recent_peak())
        move = first | (mask & (np.abs(candidate - self._held_rps) > self.deadband_z * stderr))
        self._held_rps[move] = candidate[move]

    def _recent_peak(self) -> FloatArray:
        """Largest measured rate per class over the peak window (0 where never measured)."""
        if not self._peaks:
            return np.zeros(len(self.class_keys))
        stacked = np.vstack(list(self._peaks))
        all_nan = np.all(np.isnan(stacked), axis=0)
        peak = np.max(np.where(np.isnan(stacked), -np.inf, stacked), axis=0)
        return np.where(all_nan, 0.0, peak)

    def forecast(self, default_rps: npt.ArrayLike, floor_rps: npt.ArrayLike) -> FloatArray:
        """The demand to plan for, per class (req/s): what the LP solves for.

        Parameters
        ----------
        default_rps : array_like, shape (n_classes,)
            Used for classes never measured.
        floor_rps : array_like, shape (n_classes,)
            Lower bound per class (0 for a class without engines).

        Returns
        -------
        ndarray, shape (n_classes,)
            ``max(floor, held)`` for measured classes, where ``held`` is the last
            ``max(EWMA, recent peak)`` that cleared the dead band; ``max(floor, default)``
            otherwise.
        """
        return self._per_class(self._held_rps, default_rps, floor_rps)

    def level(self, default_rps: npt.ArrayLike, floor_rps: npt.ArrayLike) -> FloatArray:
        """The demand level itself, per class (req/s): what shed fractions admit out of.

        The EWMA alone, not :meth:`forecast`'s ``max(EWMA, recent peak)``: the peak of a few
        Poisson counts sits above their mean (of 3 periods of ~10 requests, by ~0.85 standard
        errors, +27 %), which is the right bias for provisioning but sheds requests the fleet
        could serve (``bench/shed_estimator_noise.py``). Parameters and shapes as in
        :meth:`forecast`; ``max(floor, EWMA)`` for measured classes.
        """
        return self._per_class(self._ewma_rps, default_rps, floor_rps)

    def _per_class(
        self, measured_rps: FloatArray, default_rps: npt.ArrayLike, floor_rps: npt.ArrayLike
    ) -> FloatArray:
        default = np.asarray(default_rps, dtype=np.float64)
        floor = np.asarray(floor_rps, dtype=np.float64)
        n = len(self.class_keys)
        if default.shape != (n,) or floor.shape != (n,):
            raise ValueError(f"default_rps and floor_rps must have shape ({n},)")
        est = np.where(self._measured, measured_rps, default)
        return np.maximum(est, floor)


def carry_forecast(old: DemandForecaster, new: DemandForecaster) -> int:
    """Copy ``old``'s demand state into ``new`` for the class keys both have; return how many.

    EWMA, held forecast, measured flags, recent peaks and the live workers (with their pending
    and last rates restricted to ``new``'s classes) move over, so a reload neither forgets the
    measured demand nor falls back to the capacity default for classes that still exist.
    """
    # reaches into the forecasters' state: a reload (controller.service) is the only caller
    o_row, n_row = old._row, new._row
    pairs = [(o_row[k], j) for j, k in enumerate(new.class_keys) if k in o_row]
    for w_id, w in old._workers.items():
        new._workers[w_id] = replace(
            w,
            pending_requests={k: r for k, r in w.pending_requests.items() if k in n_row},
            rates_rps={k: r for k, r in w.rates_rps.items() if k in n_row},
            variances_rps2={k: v for k, v in w.variances_rps2.items() if k in n_row},
        )
    new.unknown_keys_total = old.unknown_keys_total
    if not pairs:
        return 0
    src = np.array([p[0] for p in pairs], dtype=np.intp)
    dst = np.array([p[1] for p in pairs], dtype=np.intp)
    new._ewma_rps[dst] = old._ewma_rps[src]
    new._measured[dst] = old._measured[src]
    new.last_measured_rps[dst] = old.last_measured_rps[src]
    new.last_stderr_rps[dst] = old.last_stderr_rps[src]
    new._held_rps[dst] = old._held_rps[src]
    new._peaks.clear()
    for peak in list(old._peaks)[-(new._peaks.maxlen or 1) :]:
        row = np.full(len(new.class_keys), np.nan)
        row[dst] = peak[src]
        new._peaks.append(row)
    return len(pairs)
