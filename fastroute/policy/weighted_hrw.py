"""``weighted-hrw``: weighted rendezvous hashing of the routing key over the controller's weights.

Algorithm
    The compiled selector ranks the class row's eligible engines by the rendezvous
    score ``-ln(u_i(key)) / w_i`` (smallest first; Schindelhauer & Schomaker, SPAA 2005;
    P-MinHash, Moulton & Jiang, arXiv:1809.04052). Engine ``i`` receives a share
    ``w_i / sum(w)`` of the keys, a key stays on its engine while the weights allow,
    and removing an engine moves only its keys, each to its runner-up: the ranking is
    the failover order. See ``fastroute/_core/selector_py.py`` and
    ``docs/algorithms.md`` §2.

Optional bounded-load guard (Mirrokni, Thorup & Zadimoghaddam, "Consistent Hashing
with Bounded Loads", SODA 2018, arXiv:1608.01350; docs/algorithms.md §2.4)
    With ``balance_factor = c`` the pick walks the ranking and takes the first engine
    whose load stays within ``c`` times its weighted fair share,
    ``load_e + 1 <= c * (total + 1) * w_e / W`` over the row's eligible engines
    (``Selector.pick_bounded``). The chosen engine goes first and the rest of the
    rendezvous ranking follows. A loose ``c`` (about 2) only spills hot keys under
    overload; tight factors trade away KV-cache affinity at normal load (docs/algorithms.md
    §2.4), because the LP, not this guard, balances.

Invariants
    Without the guard the decision depends only on (key, row, table, availability):
    identical in every process and on every host. ``ranked[0] == Selector.pick`` and
    ``ranked == Selector.rank`` (top ``k``).

Tunables
    ``balance_factor`` : float >= 1 or None, dimensionless; default ``None`` (off).
        2.0 is the recommended guard.
    ``load`` : ``"requests"`` or ``"tokens"``; default ``"requests"``. What the guard
        counts: in-flight requests, or in-flight prompt + expected output tokens
        (``FleetView.in_flight_tokens``; falls back to requests if the view has none).

Cost per request
    One O(n_engines) pruned, ``nogil`` loop (docs/algorithms.md §2.3; ``make bench``
    times it) plus Python call overhead; the guard adds one O(n)
    pass, and a full ranking only when the first choice is over its bound.

``Decision.reason`` is ``"hrw"``, or ``"bounded-spill"`` when the guard moved the
request off its first choice; ``scores`` is ``None``.
"""

from __future__ import annotations

from typing import ClassVar

from fastroute.policy.base import (
    DEFAULT_K,
    Decision,
    FleetView,
    Policy,
    PolicyConfigError,
    RouteRequest,
    check_k,
)

__all__ = ["WeightedHRW"]

_LOADS = ("requests", "tokens")


class WeightedHRW(Policy):
    """Weighted rendezvous hashing on the class row, with an optional bounded-load guard.

    Parameters
    ----------
    balance_factor : float or None
        Bounded-load factor ``c >= 1``; ``None`` (default) disables the guard.
    load : {"requests", "tokens"}
        Load measure of the guard; default ``"requests"``.
    """

    name: ClassVar[str] = "weighted-hrw"

    def __init__(self, *, balance_factor: float | None = None, load: str = "requests") -> None:
        if balance_factor is not None and not balance_factor >= 1.0:
            raise PolicyConfigError(
                f"weighted-hrw: balance_factor must be >= 1 (or None to disable), "
                f"got {balance_factor}"
            )
        if load not in _LOADS:
            raise PolicyConfigError(f"weighted-hrw: load must be one of {_LOADS}, got {load!r}")
        self.balance_factor = balance_factor
        self.load = load

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        mask = view.eligible(request.row)
        sel = view.selector
        if self.balance_factor is None:
            ranked = sel.rank(request.key_hash, request.row, k, mask)
            return self._decision(view, ranked, "hrw") if ranked else self._empty()
        loads = None
        if self.load == "tokens":
            loads = view.in_flight_tokens()
        if loads is None:
            loads = view.in_flight()
        first = sel.pick_bounded(request.key_hash, request.row, loads, self.balance_factor, mask)
        if first < 0:
            return self._empty()
        ranked = sel.rank(request.key_hash, request.row, k, mask)
        if first == ranked[0]:
            return self._decision(view, ranked, "hrw")
        spilled = [first] + [i for i in ranked if i != first][: k - 1]
        return self._decision(view, spilled, "bounded-spill")

    def __repr__(self) -> str:
        return f"<WeightedHRW balance_factor={self.balance_factor} load={self.load!r}>"
