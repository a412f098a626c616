"""The proxy's asyncio admission queue over the pure queue-delay guard (fake clocks, no sleeps)."""

from __future__ import annotations

import asyncio

import pytest

from fastroute.guards.admission import QueueDelayGuard, Verdict
from fastroute.proxy.path.admission import AdmissionQueue, AdmissionRejected

# -- the asyncio wrapper -----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)  # yield to the loop only: no time passes


def test_asyncio_queue_serves_waiters_in_order_and_skips_the_cancelled() -> None:
    """Waiters get slots FIFO; one cancelled while queued passes its turn on."""

    async def main() -> list[str]:
        clock = FakeClock()
        queue = AdmissionQueue(QueueDelayGuard(1, max_queue_len=4), clock=clock)
        order: list[str] = []

        async def client(name: str) -> None:
            async with queue.slot():
                order.append(name)
                await hold[name].wait()

        hold = {name: asyncio.Event() for name in "abcd"}
        tasks = {name: asyncio.create_task(client(name)) for name in "abcd"}
        await _settle()
        assert order == ["a"] and queue.guard.queue_len == 3
        tasks["b"].cancel()
        await _settle()
        for name in "acd":
            clock.now_s += 0.01
            hold[name].set()
            await _settle()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert queue.guard.in_flight == 0 and queue.guard.queue_len == 0
        assert queue.guard.cancelled_total == 1
        return order

    assert asyncio.run(main()) == ["a", "c", "d"]


def test_asyncio_queue_rejects_and_times_out() -> None:
    """A full queue raises AdmissionRejected at once; a waiter past max_wait_s times out."""

    async def main() -> None:
        clock = FakeClock()
        queue = AdmissionQueue(QueueDelayGuard(1, max_queue_len=1, max_wait_s=1e-6), clock=clock)
        await queue.acquire()
        waiter = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0)
        with pytest.raises(AdmissionRejected, match="queue is full") as full:
            await queue.acquire()
        assert full.value.admission.verdict is Verdict.REJECTED_QUEUE_FULL
        with pytest.raises(AdmissionRejected, match="in time") as late:
            await waiter
        assert late.value.admission.verdict is Verdict.REJECTED_TIMEOUT
        assert queue.guard.expired_total == 1 and queue.guard.queue_len == 0
        queue.release()
        assert queue.guard.in_flight == 0

    asyncio.run(main())


def test_asyncio_waiter_cancelled_as_it_is_granted_passes_the_slot_on() -> None:
    """A slot handed to a waiter that is cancelled before it runs is not leaked."""

    async def main() -> None:
        queue = AdmissionQueue(QueueDelayGuard(1), clock=FakeClock())
        await queue.acquire()
        first = asyncio.create_task(queue.acquire())
        second = asyncio.create_task(queue.acquire())
        await _settle()
        queue.release()  # hands the slot to `first`...
        first.cancel()  # ...which is cancelled before it resumes
        await _settle()
        assert first.cancelled()
        assert second.done() and second.exception() is None  # it got the slot
        assert queue.guard.in_flight == 1 and queue.guard.queue_len == 0
        queue.release()
        assert queue.guard.in_flight == 0

    asyncio.run(main())


def test_try_acquire_grants_without_waiting_and_queues_or_rejects_otherwise() -> None:
    """try_acquire: None when a slot is free; the queued admission to wait() on when not;
    AdmissionRejected at once when the queue is full."""

    async def main() -> None:
        queue = AdmissionQueue(QueueDelayGuard(1, max_queue_len=1), clock=FakeClock())
        assert queue.try_acquire() is None and queue.guard.in_flight == 1
        queued = queue.try_acquire()
        assert queued is not None and queued.verdict is Verdict.QUEUED
        with pytest.raises(AdmissionRejected, match="queue is full"):
            queue.try_acquire()
        waiter = asyncio.create_task(queue.wait(queued))
        await _settle()
        assert not waiter.done()
        queue.release()  # the slot goes to the queued request
        await _settle()
        assert waiter.done() and waiter.exception() is None
        assert queue.guard.in_flight == 1 and queue.guard.queue_len == 0
        queue.release()
        assert queue.guard.in_flight == 0

    asyncio.run(main())


def test_default_clock_is_the_running_loops_time() -> None:
    """Without a clock, arrivals are stamped with the running loop's time."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(QueueDelayGuard(4))
        before = loop.time()
        now = queue._now()
        assert before <= now <= loop.time()
        assert queue._now() >= now

    asyncio.run(main())
