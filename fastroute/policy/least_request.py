"""``least-request``: the eligible engine with the fewest requests in flight.

Algorithm
    Join-the-shortest-queue on the host-wide in-flight counts of the stats block
    (every worker process of the host increments and decrements them atomically, so
    the counts cover the whole data plane of this host, not one worker). Among the
    class row's eligible engines take the minimum; ties are broken by the weighted
    rendezvous order of the routing key, so equal engines share traffic by weight and
    a key keeps returning to the same engine while the tie lasts (sticky-ish, good for
    the KV cache at low load). The failover ranking repeats the rule on the engines
    not yet ranked: next-fewest in flight, ties by rendezvous order. This is the
    "least-connections" baseline of "Calibrate, Then Route" (arXiv 2609.16206) and
    Envoy's ``LEAST_REQUEST`` with full (not sampled) choice.

Invariants
    ``in_flight[ranked[0]] == min(in_flight[eligible])`` as read at decision time, and
    ``in_flight`` is non-decreasing along ``ranked``. Weights only decide eligibility
    and tie-breaks; capacity differences are ignored, so a slow engine with few
    requests keeps attracting traffic (why the LP-weighted default exists).

Tunables
    None. Other data planes (hosts) are invisible to this policy: it balances one
    host's traffic, and several hosts can still herd onto the same idle engine.

Cost per request
    ``k`` vectorised O(n_engines) passes over the counts plus one rendezvous pick for
    each tie-break.

``Decision.reason`` is ``"least-request"``; ``scores`` are the in-flight counts of
``ranked`` as read.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from fastroute.policy.base import (
    DEFAULT_K,
    Decision,
    FleetView,
    Policy,
    RouteRequest,
    check_k,
    rank_by_load,
)

__all__ = ["LeastRequest"]


class LeastRequest(Policy):
    """Fewest in-flight requests among eligible engines; ties by rendezvous order."""

    name: ClassVar[str] = "least-request"

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        eligible = view.eligible(request.row)
        # One consistent copy: the live counts may move while we rank.
        loads = np.array(view.in_flight(), dtype=np.int64)
        ranked = rank_by_load(view, request, eligible, loads, k)
        if not ranked:
            return self._empty()
        return self._decision(view, ranked, "least-request", [loads[i] for i in ranked])
