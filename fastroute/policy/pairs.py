"""The P/D pair interface: rank prefill and decode engines for one disaggregated request.

A model served by separate prefill and decode pools needs two rankings per request. A
:class:`PairSelector` returns both from one call, so a policy may couple them (a pair's
cost includes the KV transfer between its two engines:
:class:`~fastroute.policy.marginal.MarginalPairs`) or not (:class:`IndependentPairs`: any
:class:`~fastroute.policy.base.Policy`, run over each pool on its own). The proxy and the
simulator call the same interface.
"""

from __future__ import annotations

from typing import Protocol

from fastroute.policy.base import Decision, FleetView, Policy, RouteRequest

__all__ = ["PairSelector", "IndependentPairs"]


class PairSelector(Protocol):
    """Ranks prefill and decode engines for one request (the P/D policy seam).

    ``choose_pair`` returns the prefill ranking and the decode ranking, each a
    :class:`~fastroute.policy.Decision` over its pool's view; the caller tries them in
    order within the retry budget. The request comes once per pool: the same request
    with the class row of that pool (``RouteRequest.row``).
    """

    def choose_pair(
        self,
        prefill_request: RouteRequest,
        decode_request: RouteRequest,
        prefill: FleetView,
        decode: FleetView,
        k: int,
    ) -> tuple[Decision, Decision]:
        """(prefill ranking, decode ranking) for one request."""


class IndependentPairs:
    """The class's policy run over each pool independently (no pair coupling).

    Parameters
    ----------
    prefill_policy, decode_policy : Policy
        Separate instances (policies may keep per-engine state).
    """

    def __init__(self, prefill_policy: Policy, decode_policy: Policy) -> None:
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy

    def choose_pair(
        self,
        prefill_request: RouteRequest,
        decode_request: RouteRequest,
        prefill: FleetView,
        decode: FleetView,
        k: int,
    ) -> tuple[Decision, Decision]:
        return (
            self.prefill_policy.choose(prefill_request, prefill, k=k),
            self.decode_policy.choose(decode_request, decode, k=k),
        )
