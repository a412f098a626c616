"""Retry budget: a Finagle-style token bucket that bounds retry load amplification.

Algorithm (Finagle ``RetryBudget``, twitter/finagle
``finagle-core/.../service/RetryBudget.scala``; docs/algorithms.md §3):

* every original request *deposits* one token;
* every retry *withdraws* ``1 / ratio`` tokens, so at most ``ratio`` retries are
  allowed per original request;
* deposits and withdrawals expire ``ttl_s`` after they were made, so the budget
  follows the recent traffic rather than all of history;
* a *reserve* of ``min_retries_per_s × ttl_s`` retries per window is always
  available, so a quiet class (a few requests per second) can still retry.

A retry is allowed iff, over the window,
``retries + 1 <= min_retries_per_s × ttl_s + ratio × deposits``. Writing the rule in
retry units (instead of Finagle's milli-tokens) is the same inequality divided by
the withdrawal price; it keeps the arithmetic exact for ``ratio = 0`` (reserve only)
and makes a new ratio apply at once to tokens already deposited, which is what the
controller wants when it lowers the ratio during an overload.

Bound: over any run of ``T`` seconds at ``rate_rps`` original requests, retries are
at most ``ratio × requests + min_retries_per_s × T`` (one reserve per window), so
attempts per request ≤ ``1 + ratio + min_retries_per_s / rate_rps``, whatever the
failure rate: 1.102 for ratio 0.1, floor 2/s, 1000 req/s.

Memory and time: the window is a ring of ``ceil(ttl_s / slot_s)`` slots (1-s slots
by default); a slot is cleared when the clock moves past it, so memory is bounded and
each call costs O(1) amortised (at most one pass over the ring per call). Because
slots are whole seconds, an entry expires between ``ttl_s - slot_s`` and ``ttl_s``
after it was made.

The clock is injected: every call takes ``now_s`` (any monotonic clock in seconds,
``loop.time()`` in the proxy, virtual time in the simulator).
"""

from __future__ import annotations

import math

__all__ = [
    "RetryBudget",
    "DEFAULT_RATIO",
    "DEFAULT_MIN_RETRIES_PER_S",
    "DEFAULT_TTL_S",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_SLOT_S",
]

#: Retries allowed per original request (docs/algorithms.md §3: 0.1 for LLM traffic, where
#: every attempt costs GPU-seconds).
DEFAULT_RATIO = 0.1
#: Retries per second always allowed per budget, however little traffic there is.
DEFAULT_MIN_RETRIES_PER_S = 2.0
#: How long deposits and withdrawals count (Finagle's default).
DEFAULT_TTL_S = 10.0
#: Retries per request the caller's policy allows (docs/design.md §3 step 7: at most once).
DEFAULT_MAX_RETRIES = 1
#: Width of one slot of the windowed sums.
DEFAULT_SLOT_S = 1.0


class _WindowedCount:
    """A sum of integer increments over the last ``n_slots`` slots of ``slot_s`` seconds."""

    __slots__ = ("_slot_s", "_counts", "_newest", "_total")

    def __init__(self, n_slots: int, slot_s: float) -> None:
        self._slot_s = slot_s
        self._counts = [0] * n_slots
        self._newest = 0  # absolute index of the newest slot seen
        self._total = 0

    def _advance(self, now_s: float) -> int:
        slot = math.floor(now_s / self._slot_s)
        if slot <= self._newest:
            # Same slot, or a clock that stepped back: count into the newest slot
            # rather than resurrecting expired ones.
            return self._newest % len(self._counts)
        n = len(self._counts)
        if slot - self._newest >= n:
            self._counts = [0] * n
            self._total = 0
        else:
            for s in range(self._newest + 1, slot + 1):
                i = s % n
                self._total -= self._counts[i]
                self._counts[i] = 0
        self._newest = slot
        return slot % n

    def add(self, now_s: float, amount: int = 1) -> None:
        self._counts[self._advance(now_s)] += amount
        self._total += amount

    def total(self, now_s: float) -> int:
        self._advance(now_s)
        return self._total


class RetryBudget:
    """A token-bucket retry budget with expiring deposits and a per-second floor.

    One budget per (data plane, upstream engine group). Call :meth:`deposit` for every
    original request and :meth:`may_retry` (or :meth:`try_withdraw`) before every
    retry.

    Parameters
    ----------
    ratio : float
        Retries allowed per original request, ``>= 0`` (default 0.1). The controller
        publishes it with the weights table; apply it with :meth:`set_ratio`.
    min_retries_per_s : float
        Retries per second allowed regardless of traffic (default 2), ``>= 0``.
    ttl_s : float
        Seconds a deposit or withdrawal counts (default 10), ``>= slot_s``.
    max_retries : int
        Retries per request the caller's policy allows (default 1); used only by
        :meth:`may_retry`.
    slot_s : float
        Granularity of expiry in seconds (default 1).

    Attributes
    ----------
    deposits_total : int
        Original requests deposited.
    retries_allowed_total : int
        Retries the budget allowed.
    retries_refused_total : int
        Retries the budget refused (the request had retries left under
        ``max_retries`` but the budget was empty).
    """

    __slots__ = (
        "_ratio",
        "_reserve",
        "_ttl_s",
        "_min_retries_per_s",
        "max_retries",
        "_deposits",
        "_retries",
        "deposits_total",
        "retries_allowed_total",
        "retries_refused_total",
    )

    def __init__(
        self,
        ratio: float = DEFAULT_RATIO,
        min_retries_per_s: float = DEFAULT_MIN_RETRIES_PER_S,
        ttl_s: float = DEFAULT_TTL_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        *,
        slot_s: float = DEFAULT_SLOT_S,
    ) -> None:
        if not (math.isfinite(slot_s) and slot_s > 0):
            raise ValueError(f"slot_s must be a positive number of seconds, got {slot_s}")
        if not (math.isfinite(ttl_s) and ttl_s >= slot_s):
            raise ValueError(f"ttl_s must be finite and >= slot_s ({slot_s}), got {ttl_s}")
        if not (math.isfinite(min_retries_per_s) and min_retries_per_s >= 0):
            raise ValueError(f"min_retries_per_s must be finite and >= 0, got {min_retries_per_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        n_slots = math.ceil(ttl_s / slot_s)
        self._ttl_s = ttl_s
        self._min_retries_per_s = min_retries_per_s
        self._reserve = min_retries_per_s * ttl_s
        self._ratio = 0.0
        self.set_ratio(ratio)
        self.max_retries = max_retries
        self._deposits = _WindowedCount(n_slots, slot_s)
        self._retries = _WindowedCount(n_slots, slot_s)
        self.deposits_total = 0
        self.retries_allowed_total = 0
        self.retries_refused_total = 0

    @property
    def ratio(self) -> float:
        """Retries allowed per original request."""
        return self._ratio

    @property
    def ttl_s(self) -> float:
        """Seconds a deposit or withdrawal counts."""
        return self._ttl_s

    @property
    def min_retries_per_s(self) -> float:
        """The floor: retries per second allowed regardless of traffic."""
        return self._min_retries_per_s

    def set_ratio(self, ratio: float) -> None:
        """Set the retry ratio; it applies at once, to tokens already deposited too.

        Parameters
        ----------
        ratio : float
            Retries allowed per original request, finite and ``>= 0``.
        """
        if not (math.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"ratio must be finite and >= 0, got {ratio}")
        self._ratio = float(ratio)

    def deposit(self, now_s: float) -> None:
        """Record one original request (call once per request, not per attempt)."""
        self._deposits.add(now_s)
        self.deposits_total += 1

    def balance(self, now_s: float) -> float:
        """Retries the budget would allow now (may be fractional; >= 1 means one is allowed)."""
        return (
            self._reserve + self._ratio * self._deposits.total(now_s) - self._retries.total(now_s)
        )

    def try_withdraw(self, now_s: float) -> bool:
        """Take one retry from the budget if it holds one.

        Returns
        -------
        bool
            True if the retry is allowed (and has been charged), False if refused.
        """
        if self.balance(now_s) >= 1.0:
            self._retries.add(now_s)
            self.retries_allowed_total += 1
            return True
        self.retries_refused_total += 1
        return False

    def may_retry(self, attempt: int, now_s: float) -> bool:
        """Decide whether a failed attempt may be retried; charge the budget if so.

        Parameters
        ----------
        attempt : int
            0-based index of the attempt that just failed (0 = the original request),
            the same index ``Selector.rank`` candidates are tried in.
        now_s : float
            Current time in seconds.

        Returns
        -------
        bool
            True iff ``attempt < max_retries`` and the budget holds a retry. A request
            that has used its ``max_retries`` is refused without touching the budget or
            its counters.
        """
        if attempt >= self.max_retries:
            return False
        return self.try_withdraw(now_s)
