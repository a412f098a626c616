"""``round-robin``: cycle through the class row's eligible engines (baseline).

Algorithm
    Each class row has a cursor ``c`` (a request counter). A request of that row takes
    the eligible engines in table order, ``E = [e_0, ..., e_{m-1}]``, and ranks
    ``E[c mod m], E[(c + 1) mod m], ...`` (the next ``k`` in the cycle); then ``c``
    advances by one. Weights only decide eligibility (weight > 0): every eligible
    engine gets the same share, whatever its capacity. This is the baseline of
    "Calibrate, Then Route" (arXiv 2609.16206) and of SGLang's
    ``sgl-router/src/policies/round_robin.rs``.

Invariants
    Over any ``N * m`` consecutive requests of one row with a fixed eligible set, each
    engine is chosen exactly ``N`` times. When the eligible set changes the cycle
    continues from the same cursor over the new set. The cursor advances in
    ``choose`` (the decision), not in ``on_routed``, so retries do not skew the cycle.
    Cursors are per policy instance: each proxy worker process cycles on its own.

Tunables
    None.

Cost per request
    One O(n_engines) vectorised scan of the eligible mask; no hashing.

``Decision.reason`` is ``"rr"``; ``scores`` is ``None``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from fastroute.policy.base import DEFAULT_K, Decision, FleetView, Policy, RouteRequest, check_k

__all__ = ["RoundRobin"]


class RoundRobin(Policy):
    """Per-class-row round robin over eligible engines. No parameters."""

    name: ClassVar[str] = "round-robin"

    def __init__(self) -> None:
        self._cursor: dict[int, int] = {}

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        eligible = np.flatnonzero(view.eligible(request.row))
        m = len(eligible)
        if m == 0:
            return self._empty()
        c = self._cursor.get(request.row, 0)
        self._cursor[request.row] = c + 1
        ranked = [int(eligible[(c + j) % m]) for j in range(min(k, m))]
        return self._decision(view, ranked, "rr")

    def reset(self) -> None:
        self._cursor.clear()
