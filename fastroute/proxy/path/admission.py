"""The proxy's asyncio front end of the queue-delay guard, and its 429 error.

The admission logic itself — sticky shedding and the CoDel-style
:class:`~fastroute.guards.admission.QueueDelayGuard` — is pure and shared with the
simulator (:mod:`fastroute.guards.admission`); this module only parks each waiter on a
future of the running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastroute.errors import FastrouteError
from fastroute.guards.admission import Admission, QueueDelayGuard, Verdict

__all__ = ["AdmissionRejected", "AdmissionQueue"]


class AdmissionRejected(FastrouteError):
    """The admission guard refused a request; answer 429 with ``Retry-After``.

    Attributes
    ----------
    admission : Admission
        The rejecting decision (verdict and Retry-After hint).
    """

    def __init__(self, admission: Admission) -> None:
        reasons = {
            Verdict.REJECTED_QUEUE_FULL: "the upstream wait queue is full",
            Verdict.REJECTED_OVERLOADED: "queueing delay is above target (overloaded)",
            Verdict.REJECTED_TIMEOUT: "no upstream slot became free in time",
        }
        super().__init__(
            f"request rejected: {reasons.get(admission.verdict, admission.verdict.name)}; "
            f"retry after {admission.retry_after_header} s"
        )
        self.admission = admission


class AdmissionQueue:
    """asyncio front end of a :class:`QueueDelayGuard`: ``async with queue.slot(): ...``.

    Parameters
    ----------
    guard : QueueDelayGuard
        The state machine; it stays the single source of truth (counters, state).
    clock : callable, optional
        Returns the time in seconds; default the running loop's ``time()``.

    Notes
    -----
    A waiter waits at most ``guard.max_wait_s`` (an ``asyncio.timeout``), then gets
    :class:`AdmissionRejected` with ``Verdict.REJECTED_TIMEOUT``. A waiter cancelled
    (or timed out) just as it was handed a slot passes the slot on, so no slot leaks.
    """

    def __init__(self, guard: QueueDelayGuard, *, clock: Callable[[], float] | None = None) -> None:
        self.guard = guard
        self._clock = clock
        self._waiters: dict[int, asyncio.Future[None]] = {}
        # The running loop's ``time``, looked up once (asyncio.get_running_loop() costs
        # a getpid() syscall on Python 3.11; the queue serves in one loop).
        self._loop_time: Callable[[], float] | None = None

    def _now(self) -> float:
        if self._clock is not None:
            return self._clock()
        loop_time = self._loop_time
        if loop_time is None:
            loop_time = self._loop_time = asyncio.get_running_loop().time
        return loop_time()

    async def acquire(self) -> None:
        """Take a slot, waiting in the bounded queue if need be.

        Raises
        ------
        AdmissionRejected
            Queue full, guard dropping, or no slot within ``max_wait_s``.
        """
        queued = self.try_acquire()
        if queued is not None:
            await self.wait(queued)

    def try_acquire(self) -> Admission | None:
        """Take a slot now if one is free (returns None) or join the queue.

        The request path's common case, no queueing, without a coroutine. When this
        returns an admission (queued), the caller must ``await wait(admission)``.

        Raises
        ------
        AdmissionRejected
            Queue full or guard dropping.
        """
        admission = self.guard.arrive(self._now())
        if admission.verdict is Verdict.GRANTED:
            return None
        if admission.rejected:
            raise AdmissionRejected(admission)
        return admission

    async def wait(self, admission: Admission) -> None:
        """Wait for the slot of a queued ``admission`` (from :meth:`try_acquire`).

        Raises
        ------
        AdmissionRejected
            No slot within ``max_wait_s``.
        """
        ticket = admission.ticket
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = fut
        try:
            async with asyncio.timeout(self.guard.max_wait_s):
                await fut
        except BaseException as exc:
            self._waiters.pop(ticket, None)
            timed_out = isinstance(exc, TimeoutError)
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot as we gave up: pass it on
            else:
                self.guard.cancel(ticket, self._now(), timed_out=timed_out)
            if timed_out:
                rejection = Admission(Verdict.REJECTED_TIMEOUT, -1, self.guard.retry_after_s)
                raise AdmissionRejected(rejection) from None
            raise

    def release(self) -> None:
        """Give a slot back; the oldest live waiter gets it."""
        now_s = self._now()
        ticket = self.guard.release(now_s)
        while ticket is not None:
            fut = self._waiters.pop(ticket, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
                return
            # That waiter gave up while queued: the slot goes to the next one.
            ticket = self.guard.release(now_s)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body of an ``async with`` block."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()
