"""The fleet's calibration as the proxies report it, published for new workers.

Each proxy worker whose classes use ``marginal-cost`` calibrates its step-time models
online from its own requests (:class:`fastroute.predict.FleetCalibration`) and attaches a
:class:`~fastroute.predict.CalibrationSnapshot` to its report whenever it has folded in
new observations. :class:`CalibrationBoard` keeps the latest snapshot of every worker and
publishes, per engine type, the state of the worker that has seen the most samples of that
type (and likewise for the KV-transfer model): ``GET /v1/calibration``. A worker that starts
fresh loads it (:mod:`fastroute.proxy.background.calibration_pull`), so a restarted or added worker
routes with calibrated constants from its first request instead of the datasheet's.

Choosing one worker's state per type instead of averaging keeps the RLS information matrix
consistent with its coefficients (a loaded state continues exactly where its owner was).
"""

from __future__ import annotations

from collections import OrderedDict

from fastroute.signals.reports import CalibrationSnapshot

__all__ = ["CalibrationBoard", "MAX_WORKERS"]

#: Workers remembered (least recently reporting forgotten first).
MAX_WORKERS = 4096


class CalibrationBoard:
    """Latest calibration snapshot per reporting worker; the best state per engine type.

    Parameters
    ----------
    max_workers : int
        Bound on remembered workers, > 0.
    """

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._by_worker: OrderedDict[str, CalibrationSnapshot] = OrderedDict()
        self._published: CalibrationSnapshot | None = None

    def __len__(self) -> int:
        return len(self._by_worker)

    def observe(self, worker_id: str, snapshot: CalibrationSnapshot) -> None:
        """Keep ``snapshot`` as ``worker_id``'s latest."""
        self._by_worker[worker_id] = snapshot
        self._by_worker.move_to_end(worker_id)
        while len(self._by_worker) > self.max_workers:
            self._by_worker.popitem(last=False)
        self._published = None

    def published(self) -> CalibrationSnapshot | None:
        """Per type the most-sampled worker state, and the most-sampled transfer state;
        None before any worker reported a calibrated type."""
        if self._published is None and self._by_worker:
            snaps = list(self._by_worker.values())
            types = {}
            for name in sorted({t for s in snaps for t in s.types}):
                states = [s.types[name] for s in snaps if name in s.types]
                best = max(states, key=lambda st: st.n_samples)
                if best.n_samples > 0:
                    types[name] = best
            if types:
                transfer = max((s.transfer for s in snaps), key=lambda t: t.n_samples)
                self._published = CalibrationSnapshot(types=types, transfer=transfer)
        return self._published
