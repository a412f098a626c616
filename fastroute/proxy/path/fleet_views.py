"""The per-request views of a fleet that policies decide over.

:class:`RequestView` is a :class:`~fastroute.policy.FleetView` over one fleet state and
one request's residency/hardware mask; :class:`LoadView` adds the engine state the
``marginal-cost`` policy reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from fastroute.policy.marginal import EngineState
    from fastroute.proxy.path.engine_load import EngineLoad
    from fastroute.proxy.path.fleet import Fleet, FleetState

__all__ = ["RequestView", "LoadView"]


class RequestView:
    """The :class:`~fastroute.policy.FleetView` of one request over one fleet state.

    ``eligible(row)`` = weight > 0 in ``row`` AND available AND not ejected AND allowed
    by the request's residency/hardware mask.
    """

    __slots__ = ("_fleet", "_state", "_mask")

    def __init__(self, fleet: Fleet, state: FleetState, request_mask: np.ndarray) -> None:
        self._fleet = fleet
        self._state = state
        self._mask = request_mask

    @property
    def selector(self) -> Any:
        return self._state.selector

    @property
    def n_engines(self) -> int:
        return self._fleet.n_engines

    @property
    def state(self) -> FleetState:
        """The fleet state this view decides on."""
        return self._state

    def eligible(self, row: int) -> np.ndarray:
        return self._fleet.eligibility.eligible(row, self._state, self._mask)

    def in_flight(self) -> np.ndarray:
        """In-flight counts in fleet order: every worker's, when the block is shared."""
        return self._fleet.stats.in_flight()

    def in_flight_tokens(self) -> np.ndarray | None:
        """Prompt + output-budget tokens in flight per engine, every worker's when the
        block is shared: on a prefill engine the prefill work queued or running,
        elsewhere the context held."""
        return self._fleet.stats.in_flight_tokens()

    def queued_tokens(self) -> np.ndarray | None:
        """Prompt tokens per engine of the attempts in flight without a first token yet,
        every worker's when the block is shared: the prefill queued ahead of a new
        request (:class:`~fastroute.proxy.path.fleet.QueuedPrefill`), and the other
        proxies' when ``proxy.peers`` names them (``EngineStats.set_peer_queued``)."""
        return self._fleet.stats.queued_tokens()

    def prefill_cost(self) -> np.ndarray | None:
        """Each engine's time per prefilled token relative to the fastest's, from the
        configured ``capacity_rps`` (``Fleet.prefill_cost``); None when they are equal."""
        return self._fleet.prefill_cost


class LoadView(RequestView):
    """A :class:`RequestView` that is also the ``marginal-cost`` policy's
    :class:`~fastroute.policy.marginal.EngineStateView`, over an
    :class:`~fastroute.proxy.path.engine_load.EngineLoad`."""

    __slots__ = ("_load",)

    def __init__(
        self, fleet: Fleet, state: FleetState, request_mask: np.ndarray, load: EngineLoad
    ) -> None:
        super().__init__(fleet, state, request_mask)
        self._load = load

    def engine_state(self) -> EngineState:
        """Per-engine load (this worker's bookkeeping plus fresh engine scrapes)."""
        return self._load.engine_state()

    def cached_prefix_tokens(self, request: Any) -> np.ndarray | None:
        """Unknown to the proxy: the policy uses its own prefix tree."""
        return None
