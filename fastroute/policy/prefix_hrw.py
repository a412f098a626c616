"""``prefix-hrw``: rendezvous homes of the prompt's prefix depths, hot groups spread,
under a token-load bound (the default policy).

Algorithm
    Let ``P`` be the leading bytes of the request's rendered prompt (at most
    ``prefix_bytes``) and ``b = block_bytes``. The request's **depth keys** are
    ``h_j = xxh3_64(P[:b·2^j])`` for ``j = 0, 1, …`` while ``b·2^j <= len(P)``, plus the
    routing key where it is itself a prefix (chat: the messages through the first user
    message, at that depth; a session id the client sent, at depth 0), sorted by depth.
    Two requests that share a leading prefix of ``s`` bytes share every depth key up to
    ``s``, whatever follows, so a depth key names a **group** of requests that can reuse
    one KV-cache prefix, and its weighted rendezvous **home** (``Selector.rank``;
    docs/algorithms.md §2) is where that prefix is cached once one of them ran there.
    A prompt with no depth key (shorter than ``b``) uses the routing key alone.

    1. **Hot groups are skipped.** A group is hot when its decayed share of the recent
       token weight (:class:`~fastroute.policy.hot_keys.HotKeys`, half-life
       ``hot_half_life_requests``) exceeds ``h / n``, ``h = hot_share_factor`` times the
       mean engine share over the row's ``n`` eligible engines: more than its home may
       carry (it stays hot until its share falls below half that: hysteresis). The
       request is routed by the shallowest depth key that is not hot (the deepest key if
       all are), so a hot prefix (one system prompt for everybody, one RAG document)
       spreads over the homes of its sub-groups, each of which stays together.
    2. **Load bound.** Over the row's eligible engines ``E`` with LP weights ``w`` and
       in-flight tokens ``L`` (prompt + output budget of every attempt in flight from
       this host, all workers: the shared stats block), an engine is within bound iff
       ``L_e / Σ_E L <= c · w_e / Σ_E w``. The request goes to the first key's home that
       is within bound, trying the candidate keys in order; if none is, to the last
       key's rendezvous choice among the within-bound engines (never empty: the
       least-loaded engine per weight always is). The failover ranking is the rendezvous
       ranking of the key that decided (``Selector.rank_prefix``).
    3. **Cost spill.** Affinity is worth the prefill it saves. The saving is estimated as
       the deepest depth of this request that the share estimate has seen (at least the
       deciding key's depth), in tokens. If that is under
       :data:`AFFINITY_CACHED_FRACTION` of the prompt and the home holds more in-flight
       tokens than the least-loaded eligible engine by more than the saving, the request
       goes to the least-loaded engine (reason ``"cost-spill"``): unshared long prompts
       are balanced like ``least-request``, cached ones stay home. A session id the client
       declared is never cost-spilled.

Why shallowest first
    The shallowest group is the largest set of requests sharing a prefix, so routing by
    it co-locates the most reuse; a group is split (by the next depth) only when its
    demand is more than one engine's share, and the load bound absorbs what the share
    estimate has not seen yet (bursts, a cold start). ``order = "deep"`` tries the
    deepest key first instead (most specific affinity, least co-location), for
    comparison.

What it keeps from rendezvous hashing
    Homes depend only on the prompt and the table, so every worker process and every
    proxy agree on them without shared state (a per-worker record of what was sent
    where fragments; a share estimate does not: each worker sees a random sample of the
    same traffic); removing an engine moves only the groups homed on it; unrelated groups
    spread as the LP's weights say.

Tunables
    ``block_bytes`` : int >= 64, bytes; default 512 (128 tokens at 4 bytes per token).
        The shallowest depth. Below about 128 tokens a cache hit saves less prefill than
        one engine's queue costs, and 128 tokens is vLLM's CPU KV-block size (GPU blocks
        are 16 tokens, so any depth >= 16 tokens can hit there).
    ``prefix_bytes`` : int >= ``block_bytes``, bytes; default 32768 (about 8 k tokens).
        The deepest depth read. Depths double, so this is ``log2(prefix_bytes/block)+1``
        keys (7 by default) and about ``2 · prefix_bytes`` bytes hashed in the worst case.
    ``balance_factor`` : float >= 1, dimensionless; default 2.0. ``c`` of rule 2: how far
        above its LP share of the in-flight tokens an engine may go. Tighter bounds spill
        conversations away from their cache on ordinary fluctuations (1.25 cost 8 points
        of prefix hits on multi-turn chat); 1.5–3 move the families' goodput by < 0.5 %.
    ``hot_share_factor`` : float > 0, dimensionless; default 0.5. ``h`` of rule 1: a group
        keeps one engine only while it leaves at least half of that engine's share to the
        other groups that hash there (at ``h = 1`` a tenant with exactly one engine's share
        filled its home and the groups hashed beside it overloaded it: 35 % of chat-90's
        requests on one of 4 engines).
    ``hot_half_life_requests`` : float > 0, requests; default 1024. The memory of the
        share estimate. Estimating a share near the threshold ``1/n`` to ±25 % needs about
        ``16 n`` requests, so 1024 serves fleets up to about 64 engines per worker; set it
        to ``16 n`` for larger ones. Shorter reacts faster to shifts.
    ``order`` : ``"shallow"`` (default) or ``"deep"``.

Invariants
    Every ranked engine is eligible; the chosen engine is within bound unless rounding
    empties the within-bound set; same history, loads and request give the same
    decision; with no history and ``L = 0`` the decision depends only on the prompt and
    the table.

Cost per request
    Hashing at most ``2 · prefix_bytes`` bytes (xxh3), one share lookup and (on routing)
    one update per depth key, one O(n) pass for the totals and one O(n) rendezvous
    ranking per candidate key tried (one when the home is within bound), in the compiled
    selector; ``bench/bench_prefix_pick.py`` times it.

``Decision.reason``: ``"prefix-home"`` (the first candidate's home), ``"prefix-spill"``
(a later candidate's home), ``"bounded-spill"`` (no home within bound), ``"cost-spill"``
(rule 3) or ``"no-prefix"``
(prompt shorter than one block: the routing key's home, under the same bound).
``scores`` holds, for the chosen engine only, the depth in bytes of the key that decided
(-1 for the bounded fallback and the cost spill) and then 0 for the other ranked engines.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import xxhash

from fastroute.policy.base import (
    DEFAULT_K,
    Decision,
    FleetView,
    Policy,
    PolicyConfigError,
    RouteRequest,
    check_k,
)
from fastroute.policy.hot_keys import HotKeys
from fastroute.tokens import BYTES_PER_TOKEN

__all__ = ["PrefixHRW", "depth_keys"]

_ORDERS = ("shallow", "deep")
_ALL = 1 << 30
_hash = xxhash.xxh3_64_intdigest

#: A hot group stays hot until its share falls below this fraction of the entry
#: threshold (hysteresis: a group near the threshold must not flip engines per request).
HOT_LEAVE_RATIO = 0.5

#: Candidate keys tried against the load bound: the first group that is not hot and
#: its first sub-group that is not hot (then the deepest key, whose rendezvous order the
#: bounded fallback uses). More candidates cost one O(n) ranking each and rarely change
#: the pick.
MAX_CANDIDATES = 2

#: A request whose estimated cached prefix is at least this fraction of its prompt stays
#: with its home (only the c-bound moves it); below it, the request goes to the
#: least-loaded engine when the home's extra in-flight tokens exceed the saving. The
#: estimate is the deepest *seen* depth, and depths double, so it is low by up to 2x:
#: 0.25 of the estimate means less than half of the prompt truly cached. In-flight tokens
#: overstate queued work (most are contexts already prefilled), which is why the load
#: comparison is only trusted when little is saved.
AFFINITY_CACHED_FRACTION = 0.25

#: Smallest ``block_bytes`` accepted: below it a depth key is mostly chat-template bytes.
MIN_BLOCK_BYTES = 64


def depth_keys(prefix: bytes, block_bytes: int) -> list[tuple[int, int]]:
    """``(depth_bytes, xxh3_64(prefix[:depth_bytes]))`` for doubling depths, shallow first.

    Depths are ``block_bytes · 2^j`` for ``j >= 0`` while at most ``len(prefix)``; empty
    when the prefix is shorter than one block. (Unseeded xxh3 of each whole prefix: a
    seeded xxh3 derives a secret per call, which costs more than the extra bytes.)
    """
    keys = []
    depth = block_bytes
    view = memoryview(prefix)
    while depth <= len(prefix):
        keys.append((depth, _hash(view[:depth])))
        depth *= 2
    return keys


class PrefixHRW(Policy):
    """Rendezvous homes of the prompt's prefix depths, hot groups spread, load bounded.

    Parameters
    ----------
    block_bytes : int
        Shallowest prefix depth in bytes, ``>= 64``; default 512.
    prefix_bytes : int
        Deepest prefix depth read, bytes, ``>= block_bytes``; default 32768.
    balance_factor : float
        ``c >= 1``: bound on an engine's share of the in-flight tokens over its LP share;
        default 2.0.
    hot_share_factor : float
        ``h > 0``: a group whose share of the recent tokens exceeds ``h / n`` is hot;
        default 0.5.
    hot_half_life_requests : float
        Half-life of the group-share estimate, requests, ``> 0``; default 1024.
    order : {"shallow", "deep"}
        Which depth key is tried first; default ``"shallow"``.
    """

    name: ClassVar[str] = "prefix-hrw"
    needs_prefix: ClassVar[bool] = True

    def __init__(
        self,
        *,
        block_bytes: int = 512,
        prefix_bytes: int = 32768,
        balance_factor: float = 2.0,
        hot_share_factor: float = 0.5,
        hot_half_life_requests: float = 1024.0,
        order: str = "shallow",
    ) -> None:
        if not isinstance(block_bytes, int) or block_bytes < MIN_BLOCK_BYTES:
            raise PolicyConfigError(
                f"prefix-hrw: block_bytes must be an integer >= {MIN_BLOCK_BYTES}, "
                f"got {block_bytes!r}"
            )
        if not isinstance(prefix_bytes, int) or prefix_bytes < block_bytes:
            raise PolicyConfigError(
                f"prefix-hrw: prefix_bytes must be an integer >= block_bytes "
                f"({block_bytes}), got {prefix_bytes!r}"
            )
        if not balance_factor >= 1.0:
            raise PolicyConfigError(
                f"prefix-hrw: balance_factor must be >= 1, got {balance_factor!r}"
            )
        if not hot_share_factor > 0:
            raise PolicyConfigError(
                f"prefix-hrw: hot_share_factor must be > 0, got {hot_share_factor!r}"
            )
        if not hot_half_life_requests > 0:
            raise PolicyConfigError(
                f"prefix-hrw: hot_half_life_requests must be > 0, got {hot_half_life_requests!r}"
            )
        if order not in _ORDERS:
            raise PolicyConfigError(f"prefix-hrw: order must be one of {_ORDERS}, got {order!r}")
        self.block_bytes = block_bytes
        self.prefix_bytes = prefix_bytes
        self.balance_factor = float(balance_factor)
        self.hot_share_factor = float(hot_share_factor)
        self.hot_half_life_requests = float(hot_half_life_requests)
        self.order = order
        self.hot = HotKeys(self.hot_half_life_requests)
        # The keys of the last decided request, for on_routed (same request object).
        self._last: tuple[RouteRequest | None, list[int]] = (None, [])
        self._observe_upto = _ALL

    def keys(self, request: RouteRequest) -> list[tuple[int, int]]:
        """The request's ``(depth_bytes, key)`` pairs, shallow first (see the module)."""
        keys = depth_keys(request.prefix[: self.prefix_bytes], self.block_bytes)
        depth = request.key_depth_bytes
        if depth >= 0 and keys:
            at = 0
            while at < len(keys) and keys[at][0] <= depth:
                at += 1
            keys.insert(at, (depth, request.key_hash))
        return keys or [(0, request.key_hash)]

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        keys = self.keys(request)
        self._last = (request, [h for _, h in keys])
        mask = view.eligible(request.row)
        candidates = self._candidates(keys, mask)
        loads = view.in_flight_tokens()
        if loads is None:
            loads = view.in_flight()
        ranked, used = view.selector.rank_prefix(
            [h for _, h in candidates], request.row, k, loads, self.balance_factor, mask
        )
        if not ranked:
            return self._empty()
        if used >= len(candidates):
            reason, depth = "bounded-spill", -1
        else:
            depth = candidates[used][0]
            reason = "prefix-home" if used == 0 else "prefix-spill"
            if len(request.prefix) < self.block_bytes:
                reason = "no-prefix"
            declared = depth == 0 and request.key_depth_bytes == 0  # the client's session
            least = -1
            if not declared:
                least = self._cheaper_elsewhere(request, keys, depth, ranked[0], loads, view)
            if least >= 0:
                ranked = [least, *(i for i in ranked if i != least)][:k]
                reason, depth = "cost-spill", -1
        scores = (float(depth),) + (0.0,) * (len(ranked) - 1)
        return self._decision(view, ranked, reason, scores)

    def _cheaper_elsewhere(
        self,
        request: RouteRequest,
        keys: list[tuple[int, int]],
        depth: int,
        home: int,
        loads: np.ndarray,
        view: FleetView,
    ) -> int:
        """The least-loaded eligible engine if the request is mostly not cached at its
        home and the home's extra load costs more tokens than the cached part saves,
        else -1.

        The saving is estimated as the deepest depth of this request already seen by the
        share estimate (the prefix its group has sent recently), at least the deciding
        key's depth, in tokens at ``BYTES_PER_TOKEN``; the extra queue is the home's
        in-flight tokens minus the least-loaded engine's.
        """
        hot = self.hot
        seen = depth
        for d, key in reversed(keys):
            if d <= seen:
                break
            if hot.share(key) > 0.0:
                seen = d
                break
        saving_tokens = seen / BYTES_PER_TOKEN
        if saving_tokens >= AFFINITY_CACHED_FRACTION * request.prompt_tokens:
            return -1  # mostly cached at home: affinity wins, the c-bound guards the rest
        home_load = int(loads[home])
        if home_load <= saving_tokens:
            return -1  # no engine can be lighter by more than the saving
        least = view.selector.least_loaded(
            keys[-1][1], request.row, loads, view.eligible(request.row)
        )
        if least < 0 or least == home or home_load - int(loads[least]) <= saving_tokens:
            return -1
        return least

    def _candidates(self, keys: list[tuple[int, int]], mask: np.ndarray) -> list[tuple[int, int]]:
        """The keys to try, in order: those of groups that are not hot (else the deepest)."""
        hot = self.hot
        # Too few observations to tell a share from noise: nothing is hot yet.
        n_eligible = int(np.count_nonzero(mask))
        deepest, keys_by_depth = keys[-1], keys
        if self.order == "deep":
            keys = keys[::-1]
        if n_eligible > 1 and hot.requests >= 2 * n_eligible:
            enter = self.hot_share_factor / n_eligible
            leave = enter * HOT_LEAVE_RATIO
            cold = []
            for kd in keys:
                if not hot.is_hot(kd[1], enter, leave):
                    cold.append(kd)
                    if len(cold) == MAX_CANDIDATES:
                        break
            keys = cold or keys[-1:]
        else:
            keys = keys[:MAX_CANDIDATES]
        # on_routed observes through the deepest candidate's next depth.
        self._observe_upto = (
            len(keys_by_depth)
            if self.order == "deep"
            else 1 + max((i for i, kd in enumerate(keys_by_depth) if kd in keys), default=0)
        )
        # The bounded fallback ranks by the last candidate: make it the most specific key,
        # so requests that all share the candidates' prefixes do not herd onto one engine.
        if keys[-1] != deepest:
            keys = [*keys, deepest]
        return keys

    def on_routed(self, request: RouteRequest, engine_id: int) -> None:
        last, keys = self._last
        upto = self._observe_upto
        if last is not request:
            keys, upto = [h for _, h in self.keys(request)], _ALL
        weight = request.prompt_tokens + (request.expected_output_tokens or 0)
        # Shares matter down to the first group that is not hot and its sub-group:
        # deeper keys start counting when their parent becomes hot.
        self.hot.observe(keys[: upto + 1], float(max(weight, 1)))

    def reset(self) -> None:
        self.hot.reset()
        self._last = (None, [])
        self._observe_upto = _ALL

    def __repr__(self) -> str:
        return (
            f"<PrefixHRW block_bytes={self.block_bytes} prefix_bytes={self.prefix_bytes} "
            f"balance_factor={self.balance_factor} hot_share_factor={self.hot_share_factor} "
            f"hot_half_life_requests={self.hot_half_life_requests} order={self.order!r}>"
        )
