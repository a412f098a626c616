"""Fast local outlier ejection: consecutive failures take an engine out of rotation.

Semantics follow Envoy's ``consecutive_5xx`` outlier detection
(``config.cluster.v3.OutlierDetection``; docs/algorithms.md §4, "data plane,
fast, local, binary"):

* every finished attempt is recorded as an :class:`Outcome`; outcomes in
  ``failure_kinds`` (default: 5xx, connect error, timeout) extend the engine's
  failure streak, every other outcome (success, 4xx, 429) resets it;
* when the streak reaches ``consecutive_failures`` (default 5) the engine is ejected
  for ``base_ejection_s × 2**(k − 1)`` seconds, capped at ``max_ejection_s``, where
  ``k`` counts its ejections (the backoff doubles, so a flapping engine spends
  longer and longer out; the backoff starts over once an engine has stayed in for
  ``backoff_reset_s`` since its last ejection ended);
* at most ``floor(max_ejected_fraction × pool size)`` engines of a pool are ejected
  at once (default half): the engine that would exceed the cap stays in, keeps its
  streak, and is ejected by its next failure if room has been made. Ejecting every
  engine would turn a partial failure into a total one, and a pool-wide failure is
  the controller's to see, not one data plane's;
* an ejection ends when its time has passed. Nothing runs on a timer: expiry is
  checked lazily, by a heap of deadlines, on every call that takes ``now_s``;
* outcomes of an engine that is already ejected (requests sent before the
  ejection) are counted but do not change its streak.

Engines are indices ``0 .. n_engines − 1`` into the weight table's engine list;
:meth:`OutlierDetector.available_mask` is the ``uint8`` mask ``Selector.pick``
takes as ``available``. Ejected engines are skipped without renormalising the
table, so only their sessions move, each to its rendezvous runner-up.

Cost per call: O(1) for outcomes, O(log n) per ejection and expiry; the mask is
maintained in place, not rebuilt.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "Outcome",
    "OutlierDetector",
    "DEFAULT_FAILURE_KINDS",
    "DEFAULT_CONSECUTIVE_FAILURES",
    "DEFAULT_BASE_EJECTION_S",
    "DEFAULT_MAX_EJECTION_S",
    "DEFAULT_MAX_EJECTED_FRACTION",
]


class Outcome(enum.IntEnum):
    """How one attempt against an engine ended, as far as outlier detection cares."""

    SUCCESS = 0
    #: The engine answered 500–599.
    HTTP_5XX = 1
    #: TCP connect refused/reset/unreachable, TLS failure: no HTTP response at all.
    CONNECT_ERROR = 2
    #: No response (or no first byte) within the upstream timeout.
    TIMEOUT = 3
    #: The engine answered 429: alive and applying backpressure, not broken.
    RATE_LIMITED = 4
    #: The engine answered another 4xx: the request's fault, not the engine's.
    CLIENT_ERROR = 5


_KIND_TEXT = {
    Outcome.HTTP_5XX: ("5xx response", "5xx responses"),
    Outcome.CONNECT_ERROR: ("connect error", "connect errors"),
    Outcome.TIMEOUT: ("timeout", "timeouts"),
    Outcome.RATE_LIMITED: ("429 response", "429 responses"),
    Outcome.CLIENT_ERROR: ("4xx response", "4xx responses"),
}

#: Outcomes that count as failures by default.
DEFAULT_FAILURE_KINDS: frozenset[Outcome] = frozenset(
    {Outcome.HTTP_5XX, Outcome.CONNECT_ERROR, Outcome.TIMEOUT}
)
#: Failures in a row that eject an engine (Envoy's ``consecutive_5xx`` default).
DEFAULT_CONSECUTIVE_FAILURES = 5
#: First ejection's length (Envoy's ``base_ejection_time``).
DEFAULT_BASE_EJECTION_S = 30.0
#: Longest ejection (Envoy's ``max_ejection_time``).
DEFAULT_MAX_EJECTION_S = 300.0
#: Most of a pool that may be ejected at once.
DEFAULT_MAX_EJECTED_FRACTION = 0.5


class OutlierDetector:
    """Per-engine consecutive-failure ejection with exponential backoff and a pool cap.

    Parameters
    ----------
    n_engines : int
        Number of engines (indices ``0 .. n_engines − 1``).
    consecutive_failures : int
        Failures in a row that eject an engine (default 5), ``>= 1``.
    base_ejection_s : float
        Length of an engine's first ejection (default 30 s), ``> 0``.
    max_ejection_s : float
        Cap on an ejection's length (default 300 s), ``>= base_ejection_s``.
    max_ejected_fraction : float
        Fraction of a pool that may be ejected at once, in ``[0, 1]`` (default 0.5);
        the cap is ``floor(fraction × pool size)`` engines.
    failure_kinds : iterable of Outcome
        Outcomes that count as failures (default 5xx, connect error, timeout).
        ``Outcome.SUCCESS`` may not be one.
    backoff_reset_s : float, optional
        An engine ejected again more than this long after its previous ejection ended
        starts its backoff over (default ``max_ejection_s``).
    pool_ids : sequence of int, optional
        Pool of each engine (for example its model); the ejection cap applies per
        pool. Default: all engines form one pool.

    Attributes
    ----------
    ejections_total : int
        Ejections made.
    ejections_capped_total : int
        Ejections not made because the pool was at its cap.
    unejections_total : int
        Ejections that ended (time passed).
    """

    def __init__(
        self,
        n_engines: int,
        *,
        consecutive_failures: int = DEFAULT_CONSECUTIVE_FAILURES,
        base_ejection_s: float = DEFAULT_BASE_EJECTION_S,
        max_ejection_s: float = DEFAULT_MAX_EJECTION_S,
        max_ejected_fraction: float = DEFAULT_MAX_EJECTED_FRACTION,
        failure_kinds: Iterable[Outcome] = DEFAULT_FAILURE_KINDS,
        backoff_reset_s: float | None = None,
        pool_ids: Sequence[int] | None = None,
    ) -> None:
        if consecutive_failures < 1:
            raise ValueError(f"consecutive_failures must be >= 1, got {consecutive_failures}")
        if not (math.isfinite(base_ejection_s) and base_ejection_s > 0):
            raise ValueError(f"base_ejection_s must be finite and > 0, got {base_ejection_s}")
        if not (math.isfinite(max_ejection_s) and max_ejection_s >= base_ejection_s):
            raise ValueError(
                f"max_ejection_s must be finite and >= base_ejection_s ({base_ejection_s}), "
                f"got {max_ejection_s}"
            )
        if not 0.0 <= max_ejected_fraction <= 1.0:
            raise ValueError(f"max_ejected_fraction must be in [0, 1], got {max_ejected_fraction}")
        kinds = frozenset(Outcome(k) for k in failure_kinds)
        if Outcome.SUCCESS in kinds:
            raise ValueError("failure_kinds must not contain Outcome.SUCCESS")
        reset_s = max_ejection_s if backoff_reset_s is None else backoff_reset_s
        if not reset_s >= 0:
            raise ValueError(f"backoff_reset_s must be >= 0, got {backoff_reset_s}")
        self.consecutive_failures = consecutive_failures
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max_ejection_s
        self.max_ejected_fraction = max_ejected_fraction
        self.failure_kinds = kinds
        self.backoff_reset_s = reset_s
        self.ejections_total = 0
        self.ejections_capped_total = 0
        self.unejections_total = 0
        #: Goes up whenever the availability mask may have changed, so callers can cache
        #: what they derive from it (read it through :meth:`version_at`).
        self.version = 0
        self._allocate(n_engines, pool_ids)

    # -- state -------------------------------------------------------------------

    def _allocate(self, n_engines: int, pool_ids: Sequence[int] | None) -> None:
        self.version += 1
        if n_engines < 0:
            raise ValueError(f"n_engines must be >= 0, got {n_engines}")
        pools = [0] * n_engines if pool_ids is None else [int(p) for p in pool_ids]
        if len(pools) != n_engines:
            raise ValueError(f"pool_ids has {len(pools)} entries for {n_engines} engines")
        self.n_engines = n_engines
        self._pool = pools
        pool_sizes: dict[int, int] = {}
        for p in pools:
            pool_sizes[p] = pool_sizes.get(p, 0) + 1
        self._pool_cap = {
            p: math.floor(self.max_ejected_fraction * size) for p, size in pool_sizes.items()
        }
        self._pool_ejected = dict.fromkeys(pool_sizes, 0)
        self._mask = np.ones(n_engines, dtype=np.uint8)
        self._streak = [0] * n_engines
        # Failures of each kind in the current streak, for the ejection reason.
        self._streak_kinds: list[dict[Outcome, int]] = [{} for _ in range(n_engines)]
        self._times_ejected = [0] * n_engines
        self._until_s = [0.0] * n_engines  # end of the current ejection (if ejected)
        self._last_end_s = [-math.inf] * n_engines  # end of the previous ejection
        self._reason: list[str | None] = [None] * n_engines
        self._heap: list[tuple[float, int]] = []  # (until_s, engine); stale entries skipped

    def _check_engine(self, engine: int) -> None:
        if not 0 <= engine < self.n_engines:
            raise IndexError(f"engine {engine} out of range for {self.n_engines} engines")

    def _expire(self, now_s: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now_s:
            until_s, e = heapq.heappop(heap)
            if self._mask[e] or self._until_s[e] != until_s:
                continue  # stale entry (engine re-ejected or rebuilt since)
            self._uneject(e)

    def _uneject(self, e: int) -> None:
        self.version += 1
        self._mask[e] = 1
        self._last_end_s[e] = self._until_s[e]
        self._pool_ejected[self._pool[e]] -= 1
        self._reason[e] = None
        self._streak[e] = 0
        self._streak_kinds[e] = {}
        self.unejections_total += 1

    def _eject(self, e: int, now_s: float) -> None:
        self.version += 1
        if now_s - self._last_end_s[e] > self.backoff_reset_s:
            self._times_ejected[e] = 0
        self._times_ejected[e] += 1
        k = self._times_ejected[e]
        # min() before the power would overflow for a long-flapping engine.
        duration_s = min(self.max_ejection_s, self.base_ejection_s * 2.0 ** min(k - 1, 62))
        until_s = now_s + duration_s
        self._until_s[e] = until_s
        self._mask[e] = 0
        self._pool_ejected[self._pool[e]] += 1
        self._reason[e] = (
            f"{self._describe_streak(e)} at t={now_s:.3f} s: ejected for {duration_s:g} s "
            f"(ejection {k}) until t={until_s:.3f} s"
        )
        self._streak[e] = 0
        self._streak_kinds[e] = {}
        heapq.heappush(self._heap, (until_s, e))
        self.ejections_total += 1

    def _describe_streak(self, e: int) -> str:
        kinds = self._streak_kinds[e]
        n = self._streak[e]
        if len(kinds) == 1:
            (kind,) = kinds
            return f"{n} consecutive {_KIND_TEXT[kind][1 if n != 1 else 0]}"
        parts = ", ".join(
            f"{c} {_KIND_TEXT[k][1 if c != 1 else 0]}" for k, c in sorted(kinds.items())
        )
        return f"{n} consecutive failures ({parts})"

    # -- recording ---------------------------------------------------------------

    def record(self, engine: int, outcome: Outcome, now_s: float) -> bool:
        """Record how one attempt against ``engine`` ended.

        Parameters
        ----------
        engine : int
            Engine index.
        outcome : Outcome
            How the attempt ended.
        now_s : float
            Current time in seconds.

        Returns
        -------
        bool
            True iff this outcome ejected the engine.
        """
        self._check_engine(engine)
        self._expire(now_s)
        if not self._mask[engine]:
            return False  # in flight before the ejection: says nothing new
        if outcome not in self.failure_kinds:
            self._streak[engine] = 0
            if self._streak_kinds[engine]:
                self._streak_kinds[engine] = {}
            return False
        self._streak[engine] += 1
        kinds = self._streak_kinds[engine]
        kinds[outcome] = kinds.get(outcome, 0) + 1
        if self._streak[engine] < self.consecutive_failures:
            return False
        pool = self._pool[engine]
        if self._pool_ejected[pool] >= self._pool_cap[pool]:
            self.ejections_capped_total += 1
            return False
        self._eject(engine, now_s)
        return True

    def record_success(self, engine: int, now_s: float) -> None:
        """Shorthand for ``record(engine, Outcome.SUCCESS, now_s)``."""
        self.record(engine, Outcome.SUCCESS, now_s)

    def record_failure(self, engine: int, outcome: Outcome, now_s: float) -> bool:
        """Shorthand for :meth:`record` with a failure outcome; returns True if ejected."""
        if outcome is Outcome.SUCCESS:
            raise ValueError("record_failure() needs a failure outcome, not SUCCESS")
        return self.record(engine, outcome, now_s)

    # -- queries -----------------------------------------------------------------

    def available_mask(self, now_s: float) -> np.ndarray:
        """The engines not ejected at ``now_s``, as ``Selector.pick``'s ``available``.

        Returns
        -------
        numpy.ndarray of uint8, shape (n_engines,)
            1 = available, 0 = ejected. A read-only view of the detector's own mask,
            valid until the next call that changes it; copy it to keep it.
        """
        self._expire(now_s)
        view = self._mask.view()
        view.flags.writeable = False
        return view

    def is_ejected(self, engine: int, now_s: float) -> bool:
        """True iff ``engine`` is ejected at ``now_s``."""
        self._check_engine(engine)
        self._expire(now_s)
        return not self._mask[engine]

    def ejected_until_s(self, engine: int, now_s: float) -> float | None:
        """When ``engine``'s current ejection ends, or None if it is not ejected."""
        return self._until_s[engine] if self.is_ejected(engine, now_s) else None

    def reasons(self, now_s: float) -> dict[int, str]:
        """Why each currently ejected engine is out, by engine index.

        Example: ``"5 consecutive connect errors at t=12.300 s: ejected for 30 s
        (ejection 1) until t=42.300 s"``.
        """
        self._expire(now_s)
        return {e: r for e, r in enumerate(self._reason) if r is not None}

    def n_ejected(self, now_s: float) -> int:
        """Number of engines ejected at ``now_s``."""
        self._expire(now_s)
        return sum(self._pool_ejected.values())

    def failure_streak(self, engine: int) -> int:
        """Failures in a row currently counted against ``engine``."""
        self._check_engine(engine)
        return self._streak[engine]

    # -- engine set changes --------------------------------------------------------

    def rebuild(
        self,
        old_index_of: Sequence[int],
        now_s: float,
        *,
        pool_ids: Sequence[int] | None = None,
    ) -> None:
        """Adopt a new engine set, carrying each surviving engine's state over.

        Parameters
        ----------
        old_index_of : sequence of int
            For each new engine index, its index in the old set, or -1 for a new
            engine (which starts healthy with no history).
        now_s : float
            Current time in seconds.
        pool_ids : sequence of int, optional
            Pool of each new engine (default: one pool).

        Notes
        -----
        If removing engines leaves a pool with more ejected engines than its cap
        allows, the ejections that end soonest are ended now, so the cap holds.
        """
        self._expire(now_s)
        old = (
            list(self._mask),
            self._streak,
            self._streak_kinds,
            self._times_ejected,
            self._until_s,
            self._last_end_s,
            self._reason,
        )
        old_n = self.n_engines
        mapping = [int(i) for i in old_index_of]
        for i in mapping:
            if not -1 <= i < old_n:
                raise IndexError(f"old index {i} out of range for {old_n} engines")
        if len([i for i in mapping if i >= 0]) != len({i for i in mapping if i >= 0}):
            raise ValueError("old_index_of maps two new engines to the same old engine")
        self._allocate(len(mapping), pool_ids)
        mask, streak, kinds, times, until, last_end, reason = old
        for new, o in enumerate(mapping):
            if o < 0:
                continue
            self._streak[new] = streak[o]
            self._streak_kinds[new] = kinds[o]
            self._times_ejected[new] = times[o]
            self._last_end_s[new] = last_end[o]
            if not mask[o]:
                self._mask[new] = 0
                self._until_s[new] = until[o]
                self._reason[new] = reason[o]
                self._pool_ejected[self._pool[new]] += 1
                self._heap.append((until[o], new))
        heapq.heapify(self._heap)
        for pool, cap in self._pool_cap.items():
            excess = self._pool_ejected[pool] - cap
            if excess <= 0:
                continue
            ejected = sorted(
                (self._until_s[e], e)
                for e in range(self.n_engines)
                if self._pool[e] == pool and not self._mask[e]
            )
            for _, e in ejected[:excess]:
                self._until_s[e] = now_s
                self._uneject(e)

    def version_at(self, now_s: float) -> int:
        """:attr:`version` after expiring the ejections that ended by ``now_s``."""
        self._expire(now_s)
        return self.version

    def resize(
        self, n_engines: int, now_s: float, *, pool_ids: Sequence[int] | None = None
    ) -> None:
        """Grow or shrink the engine set, keeping indices ``0 .. min(old, new) − 1``.

        For appended or truncated engine lists; use :meth:`rebuild` when engines are
        reordered or removed from the middle.
        """
        keep = min(n_engines, self.n_engines)
        self.rebuild([*range(keep), *([-1] * (n_engines - keep))], now_s, pool_ids=pool_ids)
