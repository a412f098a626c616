"""``cache-aware``: prefix affinity from an approximate per-engine radix tree (SGLang-style).

Algorithm (after SGLang ``sgl-router/src/policies/cache_aware.rs``; read, not copied)
    The router cannot see the engines' KV caches, so it remembers what it sent where:
    for each engine, the prompt prefixes routed to it, in a radix tree over bytes
    (:mod:`fastroute.policy.prefix_tree`; one tree shared by all engines, each node
    tagged with the engines holding it). For a request of class row ``r``, over the
    row's eligible engines ``E`` with in-flight counts ``L``:

    1. **Imbalanced?** If ``max(L_E) - min(L_E) > balance_abs_threshold`` **and**
       ``max(L_E) > min(L_E) * balance_rel_threshold``, cache affinity yields to load:
       choose the least-loaded engine (reason ``"imbalance"``).
    2. Otherwise, with an empty prefix, do the same (reason ``"no-prefix"``: there is
       nothing to match; SGLang would send it to the smallest tree, which would pile
       every prefix-less request onto one engine).
    3. Otherwise find the engine of ``E`` holding the longest prefix of the request's
       prefix. If ``matched / len(prefix) > cache_threshold`` choose it (reason
       ``"cache-hit"``); ties (several engines hold it) go to fewer in flight.
    4. Else choose the engine of ``E`` with the smallest tree, i.e. the most cache room
       (reason ``"cache-miss"``); ties go to fewer in flight.

    Every remaining tie is broken by the weighted rendezvous order of the routing key,
    so decisions are deterministic. On ``on_routed`` the prefix is inserted into the
    tree of the engine the request actually went to (the chosen engine, or the
    failover candidate on retry), which also refreshes its recency. The failover
    ranking is the chosen engine, then the rendezvous order of the key.

Differences from SGLang, on purpose
    Bytes instead of characters (no decoding, same ratios for ASCII); loads and the
    imbalance test over the row's eligible engines only; deterministic tie-breaks
    (SGLang takes an arbitrary holder); a logical clock instead of wall time;
    eviction inline at insert, so memory is bounded at all times, instead of a
    background thread on a timer; trees keyed by stable engine ids, so a new table
    generation (reordered, added or removed engines) keeps the right history, and
    engines that leave the table are forgotten.

Invariants
    ``size(engine) <= max_tree_size`` bytes after every insert; every ranked engine is
    eligible; same (history, loads, request) gives the same decision.

Tunables (defaults as SGLang's original router; newer sgl-router versions ship
0.3 / 64 / 1.5)
    ``cache_threshold`` : float in [0, 1], fraction of prefix bytes; default 0.5.
        Minimum match fraction for affinity routing (strictly greater than).
    ``balance_abs_threshold`` : int >= 0, requests in flight; default 32.
    ``balance_rel_threshold`` : float >= 1, ratio of in-flight counts; default 1.0001.
        Both must be exceeded for the load to count as imbalanced.
    ``max_tree_size`` : int >= 1, bytes of prefix text per engine; default 4 MiB
        (``2**22``), roughly the text of a million tokens, the order of one engine's
        KV-cache capacity. LRU leaves are evicted beyond it.
    ``max_prefix_bytes`` : int >= 1, bytes; default 16384. Only this many leading
        bytes of ``RouteRequest.prefix`` are matched and inserted: bounds the per-request
        cost, and the match fraction is computed over the truncated prefix.

Memory and scope
    The tree lives in the policy instance: one per proxy worker process, each seeing
    only its own traffic (as with several SGLang routers). Share one instance across
    the classes that use it so that all traffic to an engine feeds one tree.
    Python overhead is roughly 0.5 KB per tree node on top of the label bytes.

Cost per request
    O(len(prefix)) byte comparisons in C, O(engines per node) per node on the match
    path, a few O(n_engines) vectorised passes, amortised O(log) eviction on insert.

``Decision.scores`` are the matched fractions (0 to 1) of the prefix that each
ranked engine's tree holds.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from fastroute.policy.base import (
    DEFAULT_K,
    Decision,
    FleetView,
    Policy,
    PolicyConfigError,
    RouteRequest,
    check_k,
    pick_min,
    rendezvous_tail,
)
from fastroute.policy.prefix_tree import PrefixTree

__all__ = ["CacheAware"]


class CacheAware(Policy):
    """Prefix-affinity routing with SGLang's balance thresholds.

    Parameters
    ----------
    cache_threshold : float
        Minimum matched fraction of the prefix (0 to 1) for affinity routing; 0.5.
    balance_abs_threshold : int
        Imbalance needs ``max - min`` in-flight requests above this; 32.
    balance_rel_threshold : float
        ... and ``max > min * balance_rel_threshold``; 1.0001.
    max_tree_size : int
        Bytes of prefixes remembered per engine (LRU beyond); ``2**22``.
    max_prefix_bytes : int
        Leading bytes of the request prefix used; 16384.
    """

    name: ClassVar[str] = "cache-aware"
    needs_prefix: ClassVar[bool] = True

    def __init__(
        self,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        max_tree_size: int = 2**22,
        max_prefix_bytes: int = 16384,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise PolicyConfigError(
                f"cache-aware: cache_threshold must be in [0, 1], got {cache_threshold}"
            )
        if balance_abs_threshold < 0:
            raise PolicyConfigError(
                f"cache-aware: balance_abs_threshold must be >= 0, got {balance_abs_threshold}"
            )
        if not balance_rel_threshold >= 1.0:
            raise PolicyConfigError(
                f"cache-aware: balance_rel_threshold must be >= 1, got {balance_rel_threshold}"
            )
        if max_tree_size < 1 or max_prefix_bytes < 1:
            raise PolicyConfigError(
                f"cache-aware: max_tree_size and max_prefix_bytes must be >= 1, got "
                f"{max_tree_size} and {max_prefix_bytes}"
            )
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = int(balance_abs_threshold)
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_size = int(max_tree_size)
        self.max_prefix_bytes = int(max_prefix_bytes)
        self.tree = PrefixTree(self.max_tree_size)
        self._table_selector: Any = None
        self._ids: list[int] = []
        self._index: dict[int, int] = {}

    def _sync(self, view: FleetView) -> None:
        """On a new table: re-map engine ids to indices, forget engines that left."""
        sel = view.selector
        if sel is self._table_selector:
            return
        self._ids = [int(x) for x in sel.engine_ids]
        self._index = {e: i for i, e in enumerate(self._ids)}
        for tenant in self.tree.tenants():
            if tenant not in self._index:
                self.tree.remove_tenant(tenant)
        self._table_selector = sel

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        mask = view.eligible(request.row)
        eligible = mask.astype(bool)
        if not eligible.any():
            return self._empty()
        self._sync(view)
        loads = np.array(view.in_flight(), dtype=np.int64)  # one consistent copy
        prefix = request.prefix[: self.max_prefix_bytes]
        matched = np.zeros(len(self._ids), dtype=np.int64)
        if prefix:
            for tenant, length in self.tree.match(prefix).items():
                i = self._index.get(tenant)
                if i is not None:
                    matched[i] = length

        el_loads = loads[eligible]
        hi, lo = int(el_loads.max()), int(el_loads.min())
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            chosen, reason = pick_min(view, request, eligible, loads), "imbalance"
        elif not prefix:
            chosen, reason = pick_min(view, request, eligible, loads), "no-prefix"
        else:
            best = int(matched[eligible].max())
            if best / len(prefix) > self.cache_threshold:
                holders = eligible & (matched == best)
                chosen, reason = pick_min(view, request, holders, loads), "cache-hit"
            else:
                sizes = np.array([self.tree.size(e) for e in self._ids], dtype=np.int64)
                roomiest = eligible & (sizes == sizes[eligible].min())
                chosen, reason = pick_min(view, request, roomiest, loads), "cache-miss"

        ranked = rendezvous_tail(view, request, mask, [chosen], k)
        denom = max(len(prefix), 1)
        return self._decision(view, ranked, reason, [matched[i] / denom for i in ranked])

    def on_routed(self, request: RouteRequest, engine_id: int) -> None:
        """Insert the request's prefix into ``engine_id``'s tree."""
        self.tree.insert(request.prefix[: self.max_prefix_bytes], engine_id)

    def reset(self) -> None:
        self.tree.clear()
        self._table_selector = None
        self._ids = []
        self._index = {}

    def __repr__(self) -> str:
        return (
            f"<CacheAware cache_threshold={self.cache_threshold} "
            f"balance_abs_threshold={self.balance_abs_threshold} "
            f"balance_rel_threshold={self.balance_rel_threshold} "
            f"max_tree_size={self.max_tree_size} max_prefix_bytes={self.max_prefix_bytes}>"
        )
