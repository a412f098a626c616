"""``consistent-hash``: unweighted rendezvous hashing on the routing key.

Algorithm
    Highest-random-weight hashing (Thaler & Ravishankar, "Using name-based mappings
    to increase hit rates", IEEE/ACM ToN 1998) with every eligible engine at weight 1:
    the same compiled selector and the same per-engine seeds as ``weighted-hrw``, run
    over a one-row table of ones built once per table (cached on the view's selector
    object). The class row of the controller's table only decides eligibility
    (weight > 0) and availability; the controller's weight *values* are ignored. Each
    eligible engine gets an equal share of the keys; a key stays on its engine as long
    as that engine is eligible; removing an engine moves only its keys, each to its
    runner-up, which is also the failover order.

Invariants
    The decision depends only on (key, the set of eligible engine ids): identical in
    every process and host, independent of table order and of the weights. It equals
    ``weighted-hrw`` on a row whose eligible weights are all equal.

Tunables
    None.

When to prefer it over ``weighted-hrw``
    Homogeneous fleets without a controller, or to measure what the LP weights buy.

Cost per request
    One O(n_engines) pruned ``nogil`` rendezvous rank; the ones-table selector is
    rebuilt (O(n_engines)) only when the view's selector object changes.

``Decision.reason`` is ``"ch"``; ``scores`` is ``None``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from fastroute.policy.base import DEFAULT_K, Decision, FleetView, Policy, RouteRequest, check_k

__all__ = ["ConsistentHash"]


class ConsistentHash(Policy):
    """Unweighted rendezvous hashing over the class row's eligible engines."""

    name: ClassVar[str] = "consistent-hash"

    def __init__(self) -> None:
        # Strong reference to the table's selector: keeps its id() from being reused,
        # so an identity check is a safe "same table" test.
        self._table_selector: Any = None
        self._ones: Any = None

    def _unweighted(self, view: FleetView) -> Any:
        sel = view.selector
        if sel is not self._table_selector:
            from fastroute._core import Selector

            n = sel.n_engines
            self._ones = Selector(sel.engine_ids, np.ones((1, n), dtype=np.float64))
            self._table_selector = sel
        return self._ones

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        mask = view.eligible(request.row)
        ranked = self._unweighted(view).rank(request.key_hash, 0, k, mask)
        return self._decision(view, ranked, "ch") if ranked else self._empty()

    def reset(self) -> None:
        self._table_selector = None
        self._ones = None
