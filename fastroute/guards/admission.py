"""Admission: sticky per-session shedding and a CoDel-style queue-delay guard.

Two layers (docs/algorithms.md §5; docs/design.md §3 step 3):

**Sticky shedding** (global, proactive). The controller publishes a shed fraction
per (class, priority), from the LP's shed variables. A request is shed iff
``unit_open(mix64(key_hash ^ SHED_SALT)) < shed_fraction``: the same routing key
(session) gets the same answer on every data plane, so a conversation is served
whole or not at all (a half-served conversation wastes its cached context), and
because the threshold is a fixed per-key number in (0, 1), the shed set only grows
as the fraction grows and only shrinks as it falls. The salt makes the shed
decision independent of the rendezvous pick (``Selector`` hashes
``key_hash ^ engine_seed``), so shedding takes an unbiased sample of every engine's
sessions. Priority comes from the controller's per-class fractions, not from here.

**Queue-delay guard** (local, reactive; :class:`QueueDelayGuard`). A bounded FIFO
of requests waiting for one of ``max_concurrency`` upstream slots, with CoDel's
control idea (Nichols & Jacobson, "Controlling Queue Delay", ACM Queue 2012):
a queue is bad when even its *best* waiter waited too long, i.e. when the minimum
sojourn time over an interval exceeds a target. Sojourn samples come from waiters
handed a slot (their wait) and from the head of the queue (the oldest waiter has
waited at least its age, which catches a queue that does not move at all). When
every sample for ``interval_s`` has been above ``target_s`` (equivalently, the
minimum over that interval exceeds it) the guard enters the *dropping* state and
rejects new arrivals with a Retry-After hint; it leaves dropping state at the
first waiter that got a slot within ``target_s``, or when a slot falls idle with
nobody waiting. Waiters already queued are kept (they have paid for their wait),
but never beyond ``max_wait_s``; the queue never holds more than ``max_queue_len``.

Unlike CoDel's packet queues, these waiters wait for an upstream *slot* held for a
whole generation (seconds), so slots turn over every tens to hundreds of
milliseconds even in a healthy fleet; the defaults (``target_s`` 50 ms,
``interval_s`` 500 ms) are sized to that, see ``docs/failure-handling.md``.

Everything here is pure: no I/O, the clock is a ``now_s`` argument. The core is
shared by the proxy and the simulator; the proxy's
:class:`~fastroute.proxy.path.admission.AdmissionQueue` is a small asyncio wrapper that
parks each waiter on a future.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass

from fastroute._core.selector_py import mix64, unit_open

__all__ = [
    "SHED_SALT",
    "should_shed",
    "Verdict",
    "Admission",
    "QueueDelayGuard",
    "DEFAULT_TARGET_S",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_MAX_QUEUE_LEN",
    "DEFAULT_MAX_WAIT_S",
    "DEFAULT_RETRY_AFTER_S",
]

#: XORed into the key hash before shedding, so shed decisions are independent of
#: rendezvous picks (the first 16 hex digits of pi's fraction; any constant that is
#: not an engine seed works, but every data plane must use the same one).
SHED_SALT = 0x243F6A8885A308D3

#: Sojourn time above which waiting counts as queueing delay (10 % of a 500 ms TTFT SLO).
DEFAULT_TARGET_S = 0.05
#: How long sojourns must stay above target before the guard starts rejecting.
DEFAULT_INTERVAL_S = 0.5
#: Most requests waiting for a slot at once.
DEFAULT_MAX_QUEUE_LEN = 256
#: Longest a request may wait for a slot before it is rejected.
DEFAULT_MAX_WAIT_S = 5.0
#: Retry-After sent with a rejection (the HTTP header carries whole seconds).
DEFAULT_RETRY_AFTER_S = 1.0


def should_shed(key_hash: int, shed_fraction: float) -> bool:
    """Decide, stickily per routing key, whether to shed a request.

    Parameters
    ----------
    key_hash : int
        Unsigned 64-bit routing-key hash (:func:`fastroute.proxy.path.routing_key.routing_key`).
    shed_fraction : float
        Fraction of keys to shed, published by the controller per (class, priority).
        ``<= 0`` (or NaN) sheds nothing, ``>= 1`` sheds everything.

    Returns
    -------
    bool
        True iff ``unit_open(mix64(key_hash ^ SHED_SALT)) < shed_fraction``.
    """
    if not shed_fraction > 0.0:
        return False
    return unit_open(mix64(key_hash ^ SHED_SALT)) < shed_fraction


class Verdict(enum.IntEnum):
    """What :meth:`QueueDelayGuard.arrive` decided."""

    #: A slot was free: go ahead now.
    GRANTED = 0
    #: Wait for the ticket to be handed a slot (by :meth:`QueueDelayGuard.release`).
    QUEUED = 1
    #: Rejected: the queue holds ``max_queue_len`` waiters.
    REJECTED_QUEUE_FULL = 2
    #: Rejected: the guard is in dropping state (queueing delay above target).
    REJECTED_OVERLOADED = 3
    #: Rejected after waiting ``max_wait_s`` without a slot.
    REJECTED_TIMEOUT = 4


@dataclass(frozen=True, slots=True)
class Admission:
    """The guard's answer to one arrival.

    Attributes
    ----------
    verdict : Verdict
        The decision.
    ticket : int
        The waiter's ticket when ``verdict`` is ``QUEUED``, else -1.
    retry_after_s : float
        Suggested client back-off for rejections, else 0.
    """

    verdict: Verdict
    ticket: int = -1
    retry_after_s: float = 0.0

    @property
    def rejected(self) -> bool:
        """True for every rejecting verdict."""
        return self.verdict >= Verdict.REJECTED_QUEUE_FULL

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` value: whole seconds, at least 1 (RFC 9110 delay-seconds)."""
        return str(max(1, math.ceil(self.retry_after_s)))


_GRANTED = Admission(Verdict.GRANTED)


class QueueDelayGuard:
    """Concurrency slots, a bounded FIFO of waiters and a CoDel-style delay guard.

    Parameters
    ----------
    max_concurrency : int
        Upstream slots (requests in flight at once), ``>= 1``; for example the
        controller's static in-flight cap for an engine group.
    max_queue_len : int
        Most waiters at once (default 256), ``>= 0``.
    target_s : float
        Acceptable queueing delay (default 0.05 s), ``> 0``.
    interval_s : float
        How long delay must stay above target before rejecting (default 0.5 s), ``> 0``.
    max_wait_s : float
        Longest wait for a slot (default 5 s), ``> 0``; enforced by :meth:`tick`
        (or by :class:`AdmissionQueue`'s timeout).
    retry_after_s : float
        Back-off suggested to rejected clients (default 1 s), ``>= 0``.

    Attributes
    ----------
    granted_total, queued_total, dequeued_total : int
        Arrivals granted at once; arrivals queued; waiters later handed a slot.
    rejected_full_total, rejected_overloaded_total : int
        Arrivals rejected because the queue was full / the guard was dropping.
    expired_total, cancelled_total : int
        Waiters removed after ``max_wait_s``; waiters that left on their own.
    dropping_entries_total : int
        Times the guard entered dropping state.

    Notes
    -----
    Protocol: every :meth:`arrive` that returns ``GRANTED``, and every ticket
    :meth:`release` or :meth:`set_max_concurrency` returns, owns one slot until it
    calls :meth:`release`. Every method is O(1) amortised except :meth:`tick` and
    :meth:`set_max_concurrency`, which are O(1) per waiter they return.
    """

    def __init__(
        self,
        max_concurrency: int,
        *,
        max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
        target_s: float = DEFAULT_TARGET_S,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
    ) -> None:
        if max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        for name, value in (
            ("target_s", target_s),
            ("interval_s", interval_s),
            ("max_wait_s", max_wait_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if not (math.isfinite(retry_after_s) and retry_after_s >= 0):
            raise ValueError(f"retry_after_s must be finite and >= 0, got {retry_after_s}")
        self._check_concurrency(max_concurrency)
        self.max_concurrency = max_concurrency
        self.max_queue_len = max_queue_len
        self.target_s = target_s
        self.interval_s = interval_s
        self.max_wait_s = max_wait_s
        self.retry_after_s = retry_after_s
        self._in_flight = 0
        self._waiters: OrderedDict[int, float] = OrderedDict()  # ticket -> enqueued at (s)
        self._next_ticket = 0
        self._dropping = False
        self._above_since_s: float | None = None  # sojourns above target since then
        self.granted_total = 0
        self.queued_total = 0
        self.dequeued_total = 0
        self.rejected_full_total = 0
        self.rejected_overloaded_total = 0
        self.expired_total = 0
        self.cancelled_total = 0
        self.dropping_entries_total = 0

    @staticmethod
    def _check_concurrency(n: int) -> None:
        if n < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {n}")

    # -- read-only state -------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Slots held."""
        return self._in_flight

    @property
    def queue_len(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiters)

    @property
    def dropping(self) -> bool:
        """True while the guard rejects new arrivals for queueing delay."""
        return self._dropping

    # -- the CoDel-style state machine -------------------------------------------------

    def _below_target(self) -> None:
        self._above_since_s = None
        self._dropping = False

    def _above_target(self, since_s: float, now_s: float) -> None:
        if self._above_since_s is None:
            self._above_since_s = since_s
        if not self._dropping and now_s - self._above_since_s >= self.interval_s:
            self._dropping = True
            self.dropping_entries_total += 1

    def _sample(self, enqueued_s: float, now_s: float) -> None:
        """Account one waiter's sojourn (it left the queue with a slot at ``now_s``)."""
        if now_s - enqueued_s < self.target_s:
            self._below_target()
        else:
            # It has been above target since it crossed the target, not since now.
            self._above_target(enqueued_s + self.target_s, now_s)

    def _check_head(self, now_s: float) -> None:
        """The oldest waiter's age is a lower bound on its sojourn: use it when it is late."""
        if self._waiters:
            enqueued_s = next(iter(self._waiters.values()))
            if now_s - enqueued_s >= self.target_s:
                self._above_target(enqueued_s + self.target_s, now_s)

    # -- events ------------------------------------------------------------------------

    def arrive(self, now_s: float) -> Admission:
        """A request wants a slot.

        Returns
        -------
        Admission
            ``GRANTED`` (go now), ``QUEUED`` with a ticket, or a rejection with a
            Retry-After hint.
        """
        self._check_head(now_s)
        if not self._waiters and self._in_flight < self.max_concurrency:
            self._in_flight += 1
            self.granted_total += 1
            self._below_target()  # zero sojourn
            return _GRANTED
        if self._dropping:
            self.rejected_overloaded_total += 1
            return Admission(Verdict.REJECTED_OVERLOADED, -1, self.retry_after_s)
        if len(self._waiters) >= self.max_queue_len:
            self.rejected_full_total += 1
            return Admission(Verdict.REJECTED_QUEUE_FULL, -1, self.retry_after_s)
        ticket = self._next_ticket
        self._next_ticket += 1
        self._waiters[ticket] = now_s
        self.queued_total += 1
        return Admission(Verdict.QUEUED, ticket)

    def release(self, now_s: float) -> int | None:
        """A slot holder finished; hand its slot to the oldest waiter, if any.

        Returns
        -------
        int or None
            The ticket now owning the slot (wake it), or None if the slot is free.
        """
        if self._in_flight <= 0:
            raise RuntimeError("release() without a slot held")
        self._in_flight -= 1
        if self._waiters and self._in_flight < self.max_concurrency:
            ticket, enqueued_s = self._waiters.popitem(last=False)
            self._in_flight += 1
            self.dequeued_total += 1
            self._sample(enqueued_s, now_s)
            return ticket
        if not self._waiters:
            self._below_target()  # an idle slot and nobody waiting: no queueing delay
        return None

    def cancel(self, ticket: int, now_s: float, *, timed_out: bool = False) -> bool:
        """A waiter leaves the queue without a slot (client gone, or its own timeout).

        Parameters
        ----------
        ticket : int
            The waiter's ticket.
        now_s : float
            Current time in seconds.
        timed_out : bool
            Count it as expired (waited ``max_wait_s``) rather than cancelled.

        Returns
        -------
        bool
            True if it was waiting; False if it is unknown or was already handed a
            slot (then its owner must :meth:`release` it).
        """
        self._check_head(now_s)
        if self._waiters.pop(ticket, None) is None:
            return False
        if timed_out:
            self.expired_total += 1
        else:
            self.cancelled_total += 1
        return True

    def tick(self, now_s: float) -> list[int]:
        """Update the delay state and expire waiters older than ``max_wait_s``.

        Returns
        -------
        list of int
            Tickets removed (reject them with ``Verdict.REJECTED_TIMEOUT``), oldest first.
        """
        self._check_head(now_s)
        expired: list[int] = []
        waiters = self._waiters
        while waiters:
            ticket, enqueued_s = next(iter(waiters.items()))
            if now_s - enqueued_s < self.max_wait_s:
                break  # FIFO: everyone behind is younger
            waiters.popitem(last=False)
            expired.append(ticket)
        self.expired_total += len(expired)
        return expired

    def set_max_concurrency(self, max_concurrency: int, now_s: float) -> list[int]:
        """Change the number of slots (the controller's in-flight cap).

        Lowering it never revokes a held slot: holders finish, and the excess drains.

        Returns
        -------
        list of int
            Tickets handed a slot by the increase (wake them), oldest first.
        """
        self._check_concurrency(max_concurrency)
        self.max_concurrency = max_concurrency
        granted: list[int] = []
        while self._waiters and self._in_flight < max_concurrency:
            ticket, enqueued_s = self._waiters.popitem(last=False)
            self._in_flight += 1
            self.dequeued_total += 1
            self._sample(enqueued_s, now_s)
            granted.append(ticket)
        return granted
