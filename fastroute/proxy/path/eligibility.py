"""Which engines of a fleet may serve a request, and why the others may not.

Eligibility for a request = weight > 0 in its class row AND allowed by the
controller's flags AND not ejected by the local
:class:`~fastroute.guards.outlier.OutlierDetector` AND not at its ``max_concurrency``
cap AND in an allowed zone (and hardware class, if the tenant has one). Residency and
tenant hardware are hard filters applied per request on top of the class row
(:meth:`Eligibility.request_mask`), so one row serves every tenant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fastroute.config import EngineConfig
from fastroute.guards.outlier import OutlierDetector
from fastroute.proxy.path.concurrency import ConcurrencyCaps

if TYPE_CHECKING:
    from fastroute.proxy.path.fleet import FleetState

__all__ = ["MAX_CACHED_MASKS", "Eligibility"]

#: Most distinct (zones, hardware) request masks cached.
MAX_CACHED_MASKS = 1024


class Eligibility:
    """The eligibility masks of one fleet's engines, cached, and their explanations.

    Parameters
    ----------
    engines : sequence of EngineConfig
        The fleet's engines, in fleet order (names, zones, hardware).
    serves : ndarray of bool, shape (n_rows, n_engines)
        Whether each engine serves each class row's model.
    outlier : OutlierDetector
        The fleet's ejections.
    caps : ConcurrencyCaps
        The fleet's ``max_concurrency`` caps.
    clock : callable
        Monotonic seconds (the outlier detector's clock).
    """

    def __init__(
        self,
        engines: Sequence[EngineConfig],
        serves: np.ndarray,
        outlier: OutlierDetector,
        caps: ConcurrencyCaps,
        clock: Callable[[], float],
    ) -> None:
        self.names = [e.name for e in engines]
        self.zones = np.array([e.zone or "" for e in engines], dtype=object)
        self.hardware = np.array([e.hardware for e in engines], dtype=object)
        self.serves = serves
        self.outlier = outlier
        self.caps = caps
        self.clock = clock
        self._masks: dict[tuple[frozenset[str], str | None], np.ndarray] = {}
        # Eligibility masks by (row, id(request mask)) -> (request mask, mask), valid for
        # one (state, outlier version); the request mask is kept so its id stays unique.
        self._eligible: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._eligible_for: tuple[FleetState | None, int, int] = (None, -1, -1)
        self._reasons: tuple[int, dict[int, str]] = (-1, {})

    def request_mask(self, zones: frozenset[str], hardware: str | None) -> np.ndarray:
        """bool mask of engines in ``zones`` (and of ``hardware``, if given)."""
        key = (zones, hardware)
        mask = self._masks.get(key)
        if mask is None:
            mask = np.array([z in zones for z in self.zones], dtype=bool)
            if hardware is not None:
                mask &= self.hardware == hardware
            mask.flags.writeable = False
            if len(self._masks) >= MAX_CACHED_MASKS:
                self._masks.clear()
            self._masks[key] = mask
        return mask

    def eligible(self, row: int, state: FleetState, request_mask: np.ndarray) -> np.ndarray:
        """uint8 mask: weight > 0 in ``row``, available, not ejected, not at its
        ``max_concurrency`` cap, in ``request_mask``.

        Cached per (row, request mask) for the current ``state``, outlier version and
        cap version: the inputs change rarely, and four numpy operations per request
        were a measurable share of the proxy's CPU.
        """
        version = self.outlier.version_at(self.clock())
        caps = self.caps
        cached_for = self._eligible_for
        if cached_for[0] is not state or cached_for[1] != version or cached_for[2] != caps.version:
            self._eligible = {}
            self._eligible_for = (state, version, caps.version)
        key = (row, id(request_mask))
        hit = self._eligible.get(key)
        if hit is not None and hit[0] is request_mask:
            return hit[1]
        ejected_ok = self.outlier.available_mask(self.clock()).astype(bool)
        mask = state.positive[row] & state.available & ejected_ok & request_mask
        if caps.enabled:
            mask &= caps.available
        out = mask.view(np.uint8)
        out.flags.writeable = False
        if len(self._eligible) >= MAX_CACHED_MASKS:
            self._eligible.clear()
        self._eligible[key] = (request_mask, out)
        return out

    def capped_out(self, row: int, state: FleetState, request_mask: np.ndarray) -> bool:
        """Whether some engine would be eligible for ``row`` but for its cap."""
        caps = self.caps
        if not caps.enabled or not caps.at_cap.any():
            return False
        ejected_ok = self.outlier.available_mask(self.clock()).astype(bool)
        mask = state.positive[row] & state.available & ejected_ok & request_mask
        return bool((mask & caps.at_cap).any())

    def cap_reasons(self) -> dict[int, str]:
        """Engines at their ``max_concurrency`` cap now, with why (empty without caps)."""
        caps = self.caps
        if not caps.enabled or not caps.at_cap.any():
            return {}
        return {
            int(i): f"{caps.count(int(i))} requests in flight from this worker, "
            f"max_concurrency {caps.cap(int(i))}"
            for i in np.flatnonzero(caps.at_cap)
        }

    def ejection_reasons(self) -> dict[int, str]:
        """Why each currently ejected engine is out; do not modify the result.

        Cached per outlier version: reasons change only with ejections.
        """
        version = self.outlier.version_at(self.clock())
        if self._reasons[0] != version:
            self._reasons = (version, self.outlier.reasons(self.clock()))
        return self._reasons[1]

    def explain(
        self,
        row: int,
        request_mask: np.ndarray,
        state: FleetState,
        reasons: dict[int, str] | None = None,
        at_cap: dict[int, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Why each engine of the fleet is not eligible for ``row`` (decision records).

        ``reasons``: the outlier detector's ejection reasons as of the decision
        (default: now). ``at_cap``: engines at their ``max_concurrency`` cap as of the
        decision, with why (default: now, :meth:`cap_reasons`).
        """
        if reasons is None:
            reasons = self.outlier.reasons(self.clock())
        if at_cap is None:
            at_cap = self.cap_reasons()
        out: list[dict[str, Any]] = []
        for i, name in enumerate(self.names):
            if not self.serves[row, i]:
                why, detail = "model", "does not serve the model (or is a P/D engine)"
            elif not state.positive[row, i]:
                why, detail = "weight", f"weight 0 in row {row} (generation {state.generation})"
            elif not state.available[i]:
                why, detail = "controller", "flagged unavailable or draining by the controller"
            elif not request_mask[i]:
                why, detail = "residency", f"zone {self.zones[i]!r} / hardware not allowed"
            elif i in reasons:
                why, detail = "ejected", reasons[i]
            elif i in at_cap:
                why, detail = "at_cap", at_cap[i]
            else:
                continue
            out.append({"engine": name, "filter": why, "detail": detail})
        return out
