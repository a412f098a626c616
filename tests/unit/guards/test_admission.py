"""Admission: sticky shedding and the CoDel-style queue-delay guard (fake clocks, no sleeps)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from fastroute._core import Selector
from fastroute.guards.admission import QueueDelayGuard, Verdict, should_shed

# -- sticky shedding -------------------------------------------------------------------


def random_keys(rand: random.Random, n: int) -> list[int]:
    return [rand.getrandbits(64) for _ in range(n)]


def test_shed_set_grows_monotonically_with_the_fraction(rand: random.Random) -> None:
    """A key shed at fraction f is shed at every larger fraction, and the answer is sticky."""
    keys = random_keys(rand, 20_000)
    fractions = [0.0, 0.01, 0.1, 0.25, 0.5, 0.9, 1.0]
    sets = [{k for k in keys if should_shed(k, f)} for f in fractions]
    for smaller, larger in zip(sets, sets[1:], strict=False):
        assert smaller <= larger
    assert sets[0] == set() and sets[-1] == set(keys)
    assert sets[3] == {k for k in keys if should_shed(k, 0.25)}  # same answer again


@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.3, 0.7])
def test_shed_share_matches_the_fraction(rand: random.Random, fraction: float) -> None:
    """Over 100k random keys the shed share is within 5 sigma of the fraction.

    The count is Binomial(n, f); 5 sigma makes a false alarm a ~1e-6 event even when
    FASTROUTE_TEST_SEED varies, while a biased mapping (wrong bits, a lost salt) is off
    by far more than that.
    """
    n = 100_000
    shed = sum(should_shed(k, fraction) for k in random_keys(rand, n))
    sigma = math.sqrt(n * fraction * (1 - fraction))
    assert abs(shed - n * fraction) <= 5 * sigma


def test_shedding_is_independent_of_the_pick(rand: random.Random) -> None:
    """Every engine loses about the same share of its sessions (the salt decorrelates)."""
    n, fraction = 40_000, 0.2
    selector = Selector(list(range(100, 108)), np.ones((1, 8)))
    shed_by_engine = np.zeros(8)
    keys_by_engine = np.zeros(8)
    for k in random_keys(rand, n):
        e = selector.pick(k, 0)
        keys_by_engine[e] += 1
        shed_by_engine[e] += should_shed(k, fraction)
    sigma = np.sqrt(keys_by_engine * fraction * (1 - fraction))
    assert np.all(np.abs(shed_by_engine - keys_by_engine * fraction) <= 5 * sigma)


def test_degenerate_fractions() -> None:
    """Non-positive or NaN fractions shed nothing; fractions >= 1 shed everything."""
    for k in (0, 1, 2**64 - 1):
        assert not should_shed(k, 0.0)
        assert not should_shed(k, -1.0)
        assert not should_shed(k, float("nan"))
        assert should_shed(k, 1.0)


# -- the queue-delay guard ---------------------------------------------------------------


def guard(**kwargs: float) -> QueueDelayGuard:
    params: dict[str, float] = {"target_s": 0.05, "interval_s": 0.5, "max_queue_len": 8}
    params.update(kwargs)
    return QueueDelayGuard(1, **params)  # type: ignore[arg-type]


def test_grants_while_slots_are_free_then_queues_fifo() -> None:
    """Free slots are granted at once; then waiters queue and are served oldest first."""
    g = QueueDelayGuard(2, max_queue_len=4)
    assert g.arrive(0.0).verdict is Verdict.GRANTED
    assert g.arrive(0.0).verdict is Verdict.GRANTED
    tickets = [g.arrive(0.0).ticket for _ in range(3)]
    assert g.queue_len == 3 and g.in_flight == 2
    assert [g.release(0.01) for _ in range(3)] == tickets
    assert g.release(0.01) is None and g.release(0.01) is None
    assert g.in_flight == 0
    with pytest.raises(RuntimeError, match="without a slot"):
        g.release(0.01)


def test_enters_dropping_after_an_interval_above_target_and_leaves_when_idle() -> None:
    """Sojourns above target for interval_s start rejections; an idle slot ends them."""
    g = guard()
    assert g.arrive(0.0).verdict is Verdict.GRANTED
    t1, t2, t3 = (g.arrive(0.0).ticket for _ in range(3))
    assert g.release(0.1) == t1  # waited 0.1 s: above target since 0.05
    assert not g.dropping
    assert g.release(0.54) == t2  # above target for 0.49 s < interval
    assert not g.dropping
    assert g.arrive(0.54).verdict is Verdict.QUEUED
    assert g.release(0.55) == t3  # above target for 0.5 s: dropping
    assert g.dropping and g.dropping_entries_total == 1
    rejected = g.arrive(0.56)
    assert rejected.verdict is Verdict.REJECTED_OVERLOADED and rejected.rejected
    assert rejected.retry_after_header == "1"
    assert g.release(0.6) is not None  # the last waiter (0.06 s) is still above target
    assert g.dropping
    assert g.release(0.7) is None  # slot idle, nobody waiting
    assert not g.dropping
    assert g.arrive(0.7).verdict is Verdict.GRANTED
    assert g.rejected_overloaded_total == 1


def test_leaves_dropping_when_a_waiter_is_served_within_target() -> None:
    """One waiter served faster than target_s ends the dropping state."""
    g = guard()
    g.arrive(0.0)  # granted
    g.arrive(0.0)  # queued: will wait 0.56 s
    late = g.arrive(0.54).ticket  # queued just before dropping starts
    g.release(0.56)  # above target since 0.05, for 0.51 s: dropping
    assert g.dropping
    assert g.arrive(0.56).verdict is Verdict.REJECTED_OVERLOADED
    assert g.release(0.58) == late  # waited 0.04 s < target
    assert not g.dropping
    assert g.arrive(0.58).verdict is Verdict.QUEUED


def test_short_bursts_above_target_do_not_trigger_dropping() -> None:
    """Delay above target for less than interval_s, then below it, is tolerated."""
    g = guard()
    g.arrive(0.0)
    for _ in range(5):
        g.arrive(0.0)
    for i in range(5):
        g.release(0.1 + 0.08 * i)  # sojourns 0.1 .. 0.42 s: above target for < 0.5 s
    assert not g.dropping
    g.arrive(0.5)
    g.release(0.52)  # 0.02 s: below target, the clock restarts
    assert not g.dropping
    g.arrive(0.6)
    g.release(1.0)  # above since 0.65: only 0.35 s
    assert not g.dropping


def test_a_stuck_queue_enters_dropping_from_the_head_age() -> None:
    """With no slot ever released, the oldest waiter's age alone starts rejections."""
    g = guard()
    g.arrive(0.0)
    g.arrive(0.0)
    assert g.arrive(0.549).verdict is Verdict.QUEUED
    assert g.arrive(0.55).verdict is Verdict.REJECTED_OVERLOADED


def test_queue_never_exceeds_its_bound(rand: random.Random) -> None:
    """Random arrivals, releases, cancels and ticks: the bounds and the books always hold."""
    g = QueueDelayGuard(4, max_queue_len=16, max_wait_s=2.0)
    now_s = 0.0
    holders = 0
    waiting: set[int] = set()
    seen_verdicts: set[Verdict] = set()
    for _ in range(50_000):
        now_s += rand.expovariate(200.0)
        op = rand.random()
        if op < 0.55:
            adm = g.arrive(now_s)
            seen_verdicts.add(adm.verdict)
            if adm.verdict is Verdict.GRANTED:
                holders += 1
            elif adm.verdict is Verdict.QUEUED:
                waiting.add(adm.ticket)
        elif op < 0.9 and holders:
            ticket = g.release(now_s)
            if ticket is None:
                holders -= 1
            else:
                waiting.remove(ticket)
        elif op < 0.95 and waiting:
            ticket = rand.choice(sorted(waiting))
            assert g.cancel(ticket, now_s)
            waiting.remove(ticket)
        else:
            waiting.difference_update(g.tick(now_s))
        assert 0 <= g.queue_len <= g.max_queue_len
        assert g.in_flight <= g.max_concurrency
        assert g.queue_len == len(waiting) and g.in_flight == holders
    assert seen_verdicts == {
        Verdict.GRANTED,
        Verdict.QUEUED,
        Verdict.REJECTED_QUEUE_FULL,
        Verdict.REJECTED_OVERLOADED,
    }
    assert g.queued_total == g.dequeued_total + g.cancelled_total + g.expired_total + g.queue_len


def test_tick_expires_the_oldest_waiters() -> None:
    """Waiters older than max_wait_s are removed oldest first; younger ones stay."""
    g = QueueDelayGuard(1, max_wait_s=1.0, interval_s=10.0)
    g.arrive(0.0)
    a, b, c = (g.arrive(t).ticket for t in (0.0, 0.5, 0.9))
    assert g.tick(0.99) == []
    assert g.tick(1.5) == [a, b]
    assert g.queue_len == 1 and g.expired_total == 2
    assert g.cancel(c, 1.6) and not g.cancel(c, 1.6)
    assert g.cancelled_total == 1


def test_raising_concurrency_hands_slots_to_waiters() -> None:
    """set_max_concurrency grants waiters at once; lowering it drains held slots first."""
    g = QueueDelayGuard(1)
    g.arrive(0.0)
    tickets = [g.arrive(0.0).ticket for _ in range(3)]
    assert g.set_max_concurrency(3, 0.01) == tickets[:2]
    assert g.in_flight == 3
    assert g.set_max_concurrency(1, 0.02) == []
    assert g.release(0.03) is None  # 2 held > 1 slot: no hand-off yet
    assert g.release(0.03) is None
    assert g.release(0.03) == tickets[2]


def test_full_queue_rejects_with_retry_after() -> None:
    """Beyond max_queue_len arrivals are rejected as queue-full with the configured hint."""
    g = QueueDelayGuard(1, max_queue_len=2, retry_after_s=2.5)
    verdicts = [g.arrive(0.0) for _ in range(4)]
    assert [v.verdict for v in verdicts] == [
        Verdict.GRANTED,
        Verdict.QUEUED,
        Verdict.QUEUED,
        Verdict.REJECTED_QUEUE_FULL,
    ]
    assert verdicts[-1].retry_after_s == 2.5 and verdicts[-1].retry_after_header == "3"


@pytest.mark.parametrize(
    "kwargs",
    [{"target_s": 0.0}, {"interval_s": -1.0}, {"max_wait_s": math.inf}, {"max_queue_len": -1}],
)
def test_rejects_invalid_parameters(kwargs: dict[str, float]) -> None:
    """Out-of-range parameters are a ValueError naming the parameter."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        QueueDelayGuard(1, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_concurrency"):
        QueueDelayGuard(0)
