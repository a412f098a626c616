"""The routing-policy interface shared by the proxy and the simulator.

A policy turns one request into a **decision**: a short failover ranking of engine
indices (first = chosen). It reads the fleet only through a :class:`FleetView`, which
the proxy implements over the shared-memory weight table and stats block and the
simulator implements over its own state (:class:`StaticFleetView` is a ready-made
one), so the same policy code runs in both.

Contract of every :class:`Policy` (tested for every registered policy):

* ``choose`` returns at most ``k`` **unique** engine indices, all eligible for the
  request's class row (weight > 0 in that row and available); an empty ranking
  means no engine can serve the request (the proxy answers 503);
* it is O(n_engines) per request or better (plus O(len(prefix)) for cache-aware),
  performs no I/O, never sleeps and reads no clock;
* it is deterministic given its inputs and, for randomised policies, the seed of
  the injected ``random.Random``;
* ``on_routed`` is called once per attempt with the engine the request was actually
  sent to (the chosen one, or a failover candidate on retry), ``on_complete`` once
  when that attempt finishes. Both take the engine's stable 64-bit **id**, not its
  index: an index is only meaningful for one table generation, and a new table may
  be published between the decision and a retry.

Policies are **not** thread-safe; the proxy keeps one instance per worker process
(one event loop), the simulator one per simulated router. An instance is row-aware,
so one instance can (and, for cache-aware, should) serve every class configured
with the same policy and parameters.

Failover order: unless a policy says otherwise, the candidates after the chosen one
follow the weighted rendezvous order of the routing key in the class row
(:meth:`fastroute._core.Selector.rank`), so retries are sticky and spread the way
the controller's weights say.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgspec
import numpy as np

from fastroute._core.selector_py import ZERO_WEIGHT_RATIO
from fastroute.errors import FastrouteError

__all__ = [
    "DEFAULT_K",
    "RouteRequest",
    "Decision",
    "FleetView",
    "StaticFleetView",
    "Policy",
    "PolicyConfigError",
    "check_k",
    "rendezvous_tail",
    "pick_min",
    "prefill_cost_from_capacity",
    "rank_by_load",
]

#: Length of the failover ranking a decision carries by default (docs/design.md §3 step 5).
DEFAULT_K = 3


class PolicyConfigError(FastrouteError, ValueError):
    """An unknown policy name, or parameters a policy does not accept or allow."""


class RouteRequest(msgspec.Struct, frozen=True, gc=False):
    """What a policy may know about one request.

    A frozen msgspec ``Struct`` (slotted, no GC tracking): about ten times cheaper to
    build than a frozen dataclass, which matters once per request. Not validated at
    construction; the selector rejects a ``key_hash`` outside 64 bits.

    Attributes
    ----------
    key_hash : int
        Unsigned 64-bit hash of the routing key (``fastroute.hashing.key_hash`` of the
        session id, user, or conversation prefix; docs/design.md §3 step 4).
    row : int
        The request's class row in the weight table.
    prompt_tokens : int
        Prompt length in tokens (exact or estimated); 0 if unknown.
    prefix : bytes
        Leading bytes of the prompt text (UTF-8), for prefix-affinity policies; may be
        empty. Only read by policies whose ``needs_prefix`` is true, so the proxy
        can skip extracting it otherwise.
    expected_output_tokens : int or None
        Expected output length in tokens: the marginal-cost predictor's, else the
        request's own output limit (``max_tokens``) when it sets one. Counted with the
        prompt in the in-flight tokens that token-weighted policies balance.
    key_depth_bytes : int
        Where ``key_hash`` ends in ``prefix``, when the routing key is itself a prompt
        prefix (chat: the messages through the first user message), in bytes of
        ``prefix``; 0 for a key the client declared (session header, cache key), which
        comes first; -1 (default) when the key is not about the prompt. Read by
        ``prefix-hrw``.
    """

    key_hash: int
    row: int
    prompt_tokens: int = 0
    prefix: bytes = b""
    expected_output_tokens: int | None = None
    key_depth_bytes: int = -1


class Decision(msgspec.Struct, frozen=True, gc=False):
    """The outcome of :meth:`Policy.choose`.

    A frozen msgspec ``Struct``, so ``msgspec.json.encode(decision)`` is the body of the
    decision record.

    Attributes
    ----------
    ranked : tuple of int
        Engine indices into the current table, in failover order, at most ``k`` and
        unique; ``ranked[0]`` is the chosen engine. Empty when no engine is eligible.
    engine_ids : tuple of int
        The stable 64-bit ids of ``ranked``, position by position (what the proxy
        passes to the hooks and the decision record).
    policy : str
        Registered name of the policy that decided.
    reason : str
        Short, low-cardinality token for the decision-record header and metrics
        labels (for example ``"hrw"``, ``"bounded-spill"``, ``"cache-hit"``).
    scores : tuple of float or None
        Per-``ranked`` numbers the policy decided on (in-flight counts, prefix match
        fractions, ...), documented by each policy; ``None`` when it has none.
    cached_tokens : int
        Prompt tokens the policy expects the chosen engine (``ranked[0]``) to hold in its
        prefix cache, >= 0; 0 when it has no estimate. The proxy and the simulator count
        the prompt less these as the attempt's queued prefill (``Counter.QUEUED_TOKENS``):
        a cached prefix is not prefill work the requests behind it wait for.
    """

    ranked: tuple[int, ...]
    engine_ids: tuple[int, ...]
    policy: str
    reason: str
    scores: tuple[float, ...] | None = None
    cached_tokens: int = 0

    @property
    def chosen(self) -> int | None:
        """The chosen engine index, or ``None`` when no engine is eligible."""
        return self.ranked[0] if self.ranked else None

    def queued_prefill_tokens(self, index: int, prompt_tokens: int) -> int:
        """The prompt tokens an attempt of this request at engine ``index`` queues for
        prefill: ``prompt_tokens`` less :attr:`cached_tokens` at the chosen engine (never
        below 1 token: the engine computes at least the last), the whole prompt at any
        other engine (a retry, a hedge's second leg, a migration)."""
        if self.cached_tokens <= 0 or not self.ranked or index != self.ranked[0]:
            return prompt_tokens
        return max(min(prompt_tokens, 1), prompt_tokens - self.cached_tokens)


@runtime_checkable
class FleetView(Protocol):
    """Read-only view of the fleet that policies decide on.

    Engine indices are positions in the current weight table (``selector.engine_ids``).
    Implementations must index :meth:`in_flight` by the same positions: the proxy maps
    its stats-block slots (``StatsBlock.slot(engine_id)``) to table order.
    """

    @property
    def selector(self) -> Any:
        """A :class:`fastroute._core.Selector` over the current table (same object while
        the table is unchanged, so policies may cache per-table data keyed on it)."""
        ...

    @property
    def n_engines(self) -> int:
        """Number of engines in the current table."""
        ...

    def eligible(self, row: int) -> np.ndarray:
        """uint8 mask, shape (n_engines,): weight > 0 in ``row`` and available (not
        ejected, unhealthy, unavailable or draining). Do not modify it."""
        ...

    def in_flight(self) -> np.ndarray:
        """int64, shape (n_engines,): requests sent and not finished, fleet-wide for
        this host (live; may change between reads)."""
        ...

    def in_flight_tokens(self) -> np.ndarray | None:
        """int64, shape (n_engines,): prompt + expected output tokens in flight, or
        ``None`` if this view does not track them."""
        ...

    def queued_tokens(self) -> np.ndarray | None:
        """int64, shape (n_engines,): prompt tokens of the attempts in flight that have
        no first token yet (the prefill queued ahead of a new request), or ``None`` if
        this view does not track them."""
        ...

    def prefill_cost(self) -> np.ndarray | None:
        """float64, shape (n_engines,): each engine's time per prefilled token relative
        to the fastest engine's (every value >= 1, :func:`prefill_cost_from_capacity`), or
        ``None`` when the engines are alike (or nothing tells them apart)."""
        ...


def prefill_cost_from_capacity(capacity_rps: Sequence[float] | np.ndarray) -> np.ndarray | None:
    """Each engine's time per prefilled token relative to the fastest engine's, from the
    engines' nominal capacities: ``max(capacity) / capacity_e`` (>= 1). None when every
    capacity is equal (the engines are taken to be alike) or none is positive.

    A capacity in requests per second at one request mix is work per second, so its
    inverse is time per unit of that work. It stands for prefill time per token: exact
    where prefill and decode scale alike between two engines, off by the ratio of their
    compute to their memory bandwidth otherwise (an H100 against an L4: 8x the dense
    FLOP/s, 11x the bandwidth). The engines of one class row serve one model, so what
    their capacities differ by is the hardware.
    """
    capacity = np.asarray(capacity_rps, dtype=np.float64)
    if capacity.size == 0 or not np.all(capacity > 0) or np.all(capacity == capacity[0]):
        return None
    cost = capacity.max() / capacity
    cost.flags.writeable = False
    return cost


class StaticFleetView:
    """A concrete :class:`FleetView` over plain arrays, for the simulator and tests.

    Parameters
    ----------
    engine_ids : sequence of int
        Stable unsigned 64-bit engine ids, in table order.
    weights : array_like, shape (n_classes, n_engines)
        The weight table.
    available : array_like of bool, shape (n_engines,), optional
        Engines that may be picked; default all.
    selector : Selector, optional
        Reuse an existing selector over the same table instead of building one.

    Attributes
    ----------
    loads : ndarray of int64
        In-flight requests per engine; the owner updates it in place.
    token_loads : ndarray of int64
        In-flight tokens per engine; the owner updates it in place.
    queued_loads : ndarray of int64 or None
        Queued prompt tokens per engine (no first token yet); None (untracked) unless
        the owner sets it and updates it in place.
    peer_queued : ndarray of int64 or None
        Queued prompt tokens per engine of the other proxies (the proxy's
        ``EngineStats.peer_queued``), added to ``queued_loads`` by :meth:`queued_tokens`; None
        (the default): none.
    prefill_costs : ndarray of float64 or None
        What :meth:`prefill_cost` returns (:func:`prefill_cost_from_capacity`); None (the
        default): the engines are alike.
    """

    def __init__(
        self,
        engine_ids: Sequence[int] | np.ndarray,
        weights: Any,
        available: Any = None,
        *,
        selector: Any = None,
    ) -> None:
        from fastroute._core import Selector

        self._selector = selector if selector is not None else Selector(engine_ids, weights)
        w = np.asarray(weights, dtype=np.float64)
        n = self._selector.n_engines
        # The selector treats weights below ZERO_WEIGHT_RATIO * row max as zero; so do we,
        # so that eligible() and Selector.rank() agree on every row.
        row_max = w.max(axis=1, keepdims=True) if n else np.zeros((w.shape[0], 1))
        self._positive = (w > 0) & (w >= row_max * ZERO_WEIGHT_RATIO)
        self._available = np.ones(n, dtype=bool)
        self._masks: dict[int, np.ndarray] = {}
        self.loads = np.zeros(n, dtype=np.int64)
        self.token_loads = np.zeros(n, dtype=np.int64)
        self.queued_loads: np.ndarray | None = None
        self.peer_queued: np.ndarray | None = None
        self.prefill_costs: np.ndarray | None = None
        if available is not None:
            self.set_available(available)

    @classmethod
    def from_snapshot(cls, snapshot: Any, *, allow_draining: bool = False) -> StaticFleetView:
        """A view over a :class:`fastroute.tables.TableSnapshot` and its engine flags."""
        return cls(
            snapshot.engine_ids,
            snapshot.weights,
            snapshot.available(allow_draining=allow_draining),
        )

    @property
    def selector(self) -> Any:
        return self._selector

    @property
    def n_engines(self) -> int:
        return int(self._selector.n_engines)

    def set_available(self, available: Any) -> None:
        """Replace the availability mask (ejections, health)."""
        mask = np.asarray(available, dtype=bool)
        if mask.shape != (self.n_engines,):
            raise ValueError(f"available must have shape ({self.n_engines},), got {mask.shape}")
        self._available = mask.copy()
        self._masks.clear()

    def eligible(self, row: int) -> np.ndarray:
        mask = self._masks.get(row)
        if mask is None:
            if not 0 <= row < self._positive.shape[0]:
                raise IndexError(f"row {row} out of range for {self._positive.shape[0]} classes")
            mask = (self._positive[row] & self._available).astype(np.uint8)
            mask.flags.writeable = False
            self._masks[row] = mask
        return mask

    def in_flight(self) -> np.ndarray:
        return self.loads

    def in_flight_tokens(self) -> np.ndarray | None:
        return self.token_loads

    def queued_tokens(self) -> np.ndarray | None:
        queued, peers = self.queued_loads, self.peer_queued
        if queued is None or peers is None:
            return queued
        return queued + peers

    def prefill_cost(self) -> np.ndarray | None:
        return self.prefill_costs


class Policy(abc.ABC):
    """Base class of routing policies.

    Subclasses set :attr:`name` (the registry key) and implement :meth:`choose`;
    the hooks default to no-ops. Constructor keyword arguments are the policy's
    tunables (validated, with units in the subclass docstring).
    """

    #: Registry name, also ``Decision.policy``.
    name: ClassVar[str]
    #: True if :meth:`choose` reads ``RouteRequest.prefix`` (SGLang ``needs_request_text``).
    needs_prefix: ClassVar[bool] = False
    #: Leading bytes of the prompt the policy reads from ``RouteRequest.prefix`` (when
    #: :attr:`needs_prefix`); the proxy and the simulator extract this many. An instance
    #: may override it from its tunables.
    prefix_bytes: int = 4096

    @abc.abstractmethod
    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        """Rank up to ``k`` eligible engines for ``request``; first = chosen.

        Parameters
        ----------
        request : RouteRequest
        view : FleetView
        k : int
            Maximum length of the ranking, ``>= 1``.

        Returns
        -------
        Decision
            ``ranked`` is empty when no engine of the class row is eligible.
        """

    def on_routed(self, request: RouteRequest, engine_id: int) -> None:  # noqa: B027
        """The request was sent to ``engine_id`` (once per attempt). Default: no-op."""

    def on_complete(  # noqa: B027
        self, request: RouteRequest, engine_id: int, ok: bool
    ) -> None:
        """The attempt on ``engine_id`` finished (``ok`` false on error). Default: no-op."""

    def reset(self) -> None:  # noqa: B027
        """Forget all learned state (cursors, trees). Default: no-op."""

    def attach_key_log(
        self, buffer: Any, writer_id: int, channel: int, lock_fd: int | None = None
    ) -> Any:
        """Share what this instance learns from routed requests with the host's other
        workers through the key log in ``buffer`` (``fastroute._core.keylog_py`` states
        the layout; ``writer_id`` unique among its users, ``channel`` 0-255 the traffic
        this instance routes, ``lock_fd`` the segment's file for the pure-Python twin).
        Returns the ``fastroute._core.KeyLog`` it reads and writes (its ``observed`` and
        ``lost`` counts), or None. Default: None (policies whose decisions need no
        history of other workers')."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    # -- helpers for subclasses -------------------------------------------------------

    # Per-table cache of engine ids as Python ints (class-level defaults, so subclasses
    # need not call a base __init__). Keyed on the selector object, held strongly so its
    # id() cannot be reused.
    _ids_selector: Any = None
    _ids_cache: list[int] = []  # replaced per instance, never mutated

    def _engine_ids(self, view: FleetView) -> list[int]:
        sel = view.selector
        if sel is not self._ids_selector:
            self._ids_cache = [int(x) for x in sel.engine_ids]
            self._ids_selector = sel
        return self._ids_cache

    def _decision(
        self,
        view: FleetView,
        ranked: Sequence[int],
        reason: str,
        scores: Sequence[float] | None = None,
    ) -> Decision:
        ids = self._engine_ids(view)
        ranked_t = tuple(map(int, ranked))
        return Decision(
            ranked=ranked_t,
            engine_ids=tuple([ids[i] for i in ranked_t]),
            policy=self.name,
            reason=reason,
            scores=None if scores is None else tuple(map(float, scores)),
        )

    def _empty(self) -> Decision:
        return Decision((), (), self.name, "no-eligible-engine")


def check_k(k: int) -> int:
    """Validate the ranking length."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return k


def rendezvous_tail(
    view: FleetView,
    request: RouteRequest,
    mask: np.ndarray,
    head: Sequence[int],
    k: int,
    *,
    selector: Any = None,
    row: int | None = None,
) -> list[int]:
    """Complete ``head`` to ``k`` entries in rendezvous order of the request's key.

    Parameters
    ----------
    view : FleetView
    request : RouteRequest
    mask : ndarray of uint8
        Engines allowed in the tail (normally ``view.eligible(request.row)``).
    head : sequence of int
        Engines already ranked (kept first, in order, never repeated).
    k : int
        Target length.
    selector, row : optional
        Rank with another selector/row (consistent-hash uses an unweighted one).

    Returns
    -------
    list of int
        ``list(head)`` followed by up to ``k - len(head)`` more engines.
    """
    out = list(head)
    need = k - len(out)
    if need <= 0:
        return out[:k]
    sel = view.selector if selector is None else selector
    for i in sel.rank(request.key_hash, request.row if row is None else row, k, mask):
        if i not in out:
            out.append(i)
            if len(out) == k:
                break
    return out


def pick_min(
    view: FleetView,
    request: RouteRequest,
    mask: np.ndarray,
    values: np.ndarray,
) -> int:
    """The engine in ``mask`` with the smallest ``values``; ties by rendezvous order.

    Ties are broken by the weighted rendezvous order of the request's key in its class
    row, so equal candidates split traffic by weight and a key keeps landing on the
    same one while the tie lasts. ``mask`` must be a subset of the row's eligible
    engines and non-empty; returns -1 if it is empty.
    """
    sel = mask.astype(bool, copy=False)
    candidates = values[sel]
    if not candidates.size:
        return -1
    ties = sel & (values == candidates.min())
    return int(view.selector.pick(request.key_hash, request.row, ties.view(np.uint8)))


def rank_by_load(
    view: FleetView,
    request: RouteRequest,
    eligible: np.ndarray,
    loads: np.ndarray,
    k: int,
) -> list[int]:
    """Up to ``k`` engines of ``eligible`` by ascending ``loads``, ties by rendezvous order.

    Each position is :func:`pick_min` over the engines not yet ranked, so the ranking is
    the failover order a load-based policy wants. ``eligible`` is not modified.
    """
    remaining = eligible.astype(bool)  # a copy: picked engines are cleared in it
    ranked: list[int] = []
    while len(ranked) < k:
        best = pick_min(view, request, remaining, loads)
        if best < 0:
            break
        ranked.append(best)
        remaining[best] = False
    return ranked
