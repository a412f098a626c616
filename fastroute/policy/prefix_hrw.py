"""``prefix-hrw``: prefix-depth rendezvous hashing under a token-load bound (the default).

Algorithm
    Let ``P`` be the leading bytes of the request's rendered prompt (at most
    ``prefix_bytes``) and ``b = block_bytes``. The request's **depth keys** are
    ``h_j = xxh3_64(P[:b·2^j])`` for ``j = 0, 1, …`` while ``b·2^j <= len(P)``: one key
    per prefix depth, doubling (a prompt shorter than ``b`` has the routing key
    ``RouteRequest.key_hash`` as its only key). Two requests that share a leading prefix
    of ``s`` bytes share every depth key with ``b·2^j <= s``, whatever follows, so a
    depth key names a group of requests that can reuse one KV-cache prefix, and its
    weighted rendezvous **home** (``Selector.rank``; docs/algorithms.md §2) is where that
    prefix is cached once any of them has run there.

    Over the class row's eligible engines ``E`` with LP weights ``w`` and in-flight
    tokens ``L`` (prompt + expected output of every attempt in flight from this host,
    all workers: the shared stats block), an engine is **within bound** iff
    ``L_e / Σ_E L <= c · w_e / Σ_E w``: its share of the work in flight is at most
    ``c = balance_factor`` times the share the controller gave it. The request goes to
    the home of the **shallowest** depth key whose home is within bound; if none is,
    to the deepest key's rendezvous choice among the within-bound engines (never
    empty: the least-loaded engine per weight always is). The failover ranking is the
    rendezvous ranking of the key that decided (``Selector.rank_prefix``).

Why shallowest first
    The shallowest depth is the largest group that shares a prefix, so routing by it
    co-locates the most reuse (every request that shares any cached block with another
    shares its first block). When that group is more than its home can take, the bound
    sends the excess one depth deeper, where the group splits by what follows the
    shared block: a hot prefix (one system prompt for everybody, one RAG document)
    is replicated on as many homes as its load needs, each sub-group staying together.
    ``order = "deep"`` tries the deepest key first instead (most specific affinity,
    least co-location) and is kept for comparison.

What it keeps from rendezvous hashing
    No shared state beyond load: every worker process and every proxy computes the same
    keys and homes from the same table, so affinity does not fragment across workers or
    proxies (a per-worker tree does); removing an engine moves only the groups homed on
    it; with balanced load every group is on its home, and the homes of unrelated groups
    spread as the LP's weights say. Load decides only which depth (or which within-bound
    engine) is used, so the bound is what keeps an engine from exceeding ``c`` times its
    share, in tokens, the currency in which prefill and KV cost.

Tunables
    ``block_bytes`` : int >= 64, bytes; default 512 (128 tokens at 4 bytes per token).
        The shallowest depth. Below about 128 tokens a cache hit saves less prefill than
        one engine's queue costs, and 128 tokens is vLLM's CPU KV-block size (GPU blocks
        are 16 tokens, so any depth >= 16 tokens can hit there).
    ``prefix_bytes`` : int >= ``block_bytes``, bytes; default 32768 (about 8 k tokens).
        The deepest depth read. Depths double, so this is ``log2(prefix_bytes/block)+1``
        keys (7 by default) and about ``2 · prefix_bytes`` bytes hashed in the worst case.
    ``balance_factor`` : float >= 1, dimensionless; default 1.25. ``c`` above: how far
        an engine may run above its LP share of the in-flight tokens before its groups
        go one depth deeper. Smaller balances better and reuses less.
    ``order`` : ``"shallow"`` (default) or ``"deep"``.

Invariants
    Every ranked engine is eligible; the chosen engine is within bound unless rounding
    empties the within-bound set; identical inputs give identical decisions in every
    process; with ``L = 0`` the decision depends only on the prompt and the table.

Cost per request
    Hashing at most ``2 · prefix_bytes`` bytes (xxh3, a few GB/s), one O(n) pass for the
    totals and one O(n) rendezvous ranking per depth tried (one when the home is within
    bound), all in the compiled selector; ``bench/bench_prefix_pick.py`` times it.

``Decision.reason``: ``"prefix-home"`` (the first key's home), ``"prefix-spill"`` (a
later key's home), ``"bounded-spill"`` (no home within bound) or ``"no-prefix"`` (prompt
shorter than one block: the routing key's home, under the same bound). ``scores`` holds
the depth in bytes of the key that decided, for the chosen engine only (0 for the
routing key, -1 for the bounded fallback).
"""

from __future__ import annotations

from typing import ClassVar

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

__all__ = ["PrefixHRW", "depth_keys"]

_ORDERS = ("shallow", "deep")
_hash = xxhash.xxh3_64_intdigest

#: Smallest ``block_bytes`` accepted: below it a depth key is mostly chat-template bytes.
MIN_BLOCK_BYTES = 64


def depth_keys(prefix: bytes, block_bytes: int) -> list[tuple[int, int]]:
    """``(depth_bytes, xxh3_64(prefix[:depth_bytes]))`` for doubling depths, shallow first.

    Depths are ``block_bytes · 2^j`` for ``j >= 0`` while at most ``len(prefix)``; empty
    when the prefix is shorter than one block.
    """
    keys = []
    depth = block_bytes
    view = memoryview(prefix)
    while depth <= len(prefix):
        keys.append((depth, _hash(view[:depth])))
        depth *= 2
    return keys


class PrefixHRW(Policy):
    """Prefix-depth rendezvous hashing under a token-load bound.

    Parameters
    ----------
    block_bytes : int
        Shallowest prefix depth in bytes, ``>= 64``; default 512.
    prefix_bytes : int
        Deepest prefix depth read, bytes, ``>= block_bytes``; default 32768.
    balance_factor : float
        Bound ``c >= 1`` on an engine's share of in-flight tokens over its weight
        share; default 1.25.
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
        balance_factor: float = 1.25,
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
        if order not in _ORDERS:
            raise PolicyConfigError(f"prefix-hrw: order must be one of {_ORDERS}, got {order!r}")
        self.block_bytes = block_bytes
        self.prefix_bytes = prefix_bytes
        self.balance_factor = float(balance_factor)
        self.order = order

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        keys = depth_keys(request.prefix[: self.prefix_bytes], self.block_bytes)
        if not keys:
            keys = [(0, request.key_hash)]
        elif self.order == "deep":
            keys.reverse()
        loads = view.in_flight_tokens()
        if loads is None:
            loads = view.in_flight()
        mask = view.eligible(request.row)
        ranked, used = view.selector.rank_prefix(
            [h for _, h in keys], request.row, k, loads, self.balance_factor, mask
        )
        if not ranked:
            return self._empty()
        if used >= len(keys):
            reason, depth = "bounded-spill", -1
        else:
            depth = keys[used][0]
            reason = "no-prefix" if depth == 0 else ("prefix-home" if used == 0 else "prefix-spill")
        scores = (float(depth),) + (0.0,) * (len(ranked) - 1)
        return self._decision(view, ranked, reason, scores)

    def __repr__(self) -> str:
        return (
            f"<PrefixHRW block_bytes={self.block_bytes} prefix_bytes={self.prefix_bytes} "
            f"balance_factor={self.balance_factor} order={self.order!r}>"
        )
