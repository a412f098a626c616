"""Outlier ejection: consecutive failures, doubling backoff, pool cap, lazy recovery."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fastroute._core import Selector
from fastroute.guards.outlier import Outcome, OutlierDetector


def fail(det: OutlierDetector, engine: int, n: int, now_s: float, kind=Outcome.HTTP_5XX) -> bool:
    """Record ``n`` failures; return whether the last one ejected the engine."""
    ejected = False
    for _ in range(n):
        ejected = det.record(engine, kind, now_s)
    return ejected


def test_ejects_after_n_consecutive_failures_with_a_reason() -> None:
    """The 5th consecutive failure ejects; the mask and the reason say so."""
    det = OutlierDetector(4)
    assert not fail(det, 1, 4, 12.3, Outcome.CONNECT_ERROR)
    assert det.available_mask(12.3).tolist() == [1, 1, 1, 1]
    assert det.record(1, Outcome.CONNECT_ERROR, 12.3)
    mask = det.available_mask(12.3)
    assert mask.dtype == np.uint8 and mask.tolist() == [1, 0, 1, 1]
    assert det.reasons(12.3) == {
        1: "5 consecutive connect errors at t=12.300 s: ejected for 30 s (ejection 1) "
        "until t=42.300 s"
    }
    assert det.ejections_total == 1


def test_mixed_failure_kinds_are_itemised_in_the_reason() -> None:
    """A streak of different failures counts as one streak and is described by kind."""
    det = OutlierDetector(2, consecutive_failures=3)
    det.record(0, Outcome.HTTP_5XX, 0.0)
    det.record(0, Outcome.TIMEOUT, 0.0)
    assert det.record(0, Outcome.TIMEOUT, 0.0)
    assert det.reasons(0.0)[0].startswith("3 consecutive failures (1 5xx response, 2 timeouts)")


def test_success_resets_the_streak() -> None:
    """Four failures, one success, four failures: never five in a row, never ejected."""
    det = OutlierDetector(2)
    fail(det, 0, 4, 0.0)
    det.record_success(0, 0.0)
    assert det.failure_streak(0) == 0
    assert not fail(det, 0, 4, 0.0)
    assert not det.is_ejected(0, 0.0)


@pytest.mark.parametrize("outcome", [Outcome.RATE_LIMITED, Outcome.CLIENT_ERROR])
def test_outcomes_outside_failure_kinds_reset_the_streak(outcome: Outcome) -> None:
    """A 429 or 4xx means the engine answered: it resets the streak unless configured."""
    det = OutlierDetector(2)
    fail(det, 0, 4, 0.0)
    det.record(0, outcome, 0.0)
    assert det.failure_streak(0) == 0
    strict = OutlierDetector(2, failure_kinds={outcome})
    assert fail(strict, 0, 5, 0.0, outcome)


def test_backoff_doubles_up_to_the_cap() -> None:
    """Ejection k lasts base * 2**(k-1): 30, 60, 120, 240, then capped at 300 s."""
    det = OutlierDetector(4)
    now_s = 0.0
    durations = []
    for _ in range(6):
        assert fail(det, 2, 5, now_s)
        until_s = det.ejected_until_s(2, now_s)
        assert until_s is not None
        durations.append(until_s - now_s)
        now_s = until_s  # back in at once, and failing again
    assert durations == [30.0, 60.0, 120.0, 240.0, 300.0, 300.0]


def test_backoff_starts_over_after_a_quiet_period() -> None:
    """An engine that stays in for backoff_reset_s is treated as a first offender again."""
    det = OutlierDetector(2, base_ejection_s=10.0, max_ejection_s=100.0, backoff_reset_s=50.0)
    fail(det, 0, 5, 0.0)
    fail(det, 0, 5, 10.0)  # ejection 2: 20 s, ends at 30
    assert det.ejected_until_s(0, 10.0) == 30.0
    fail(det, 0, 5, 80.0)  # exactly 50 s quiet: still remembered
    assert det.ejected_until_s(0, 80.0) == 80.0 + 40.0
    fail(det, 0, 5, 170.1)  # 50.1 s quiet: starts over
    assert det.ejected_until_s(0, 170.1) == pytest.approx(180.1)


def test_recovers_when_the_ejection_time_has_passed() -> None:
    """Un-ejection is lazy but exact: out until the deadline, in from it on."""
    det = OutlierDetector(3)
    fail(det, 0, 5, 100.0)
    assert det.available_mask(129.999).tolist() == [0, 1, 1]
    assert det.available_mask(130.0).tolist() == [1, 1, 1]
    assert det.unejections_total == 1
    assert det.reasons(130.0) == {}
    assert det.failure_streak(0) == 0


def test_outcomes_while_ejected_are_ignored() -> None:
    """Failures of requests sent before the ejection neither extend nor restart it."""
    det = OutlierDetector(2)
    fail(det, 0, 5, 0.0)
    assert not fail(det, 0, 20, 1.0)
    assert det.ejected_until_s(0, 1.0) == 30.0
    assert det.failure_streak(0) == 0
    assert det.ejections_total == 1


def test_ejected_fraction_is_capped() -> None:
    """At most half the pool is out; the engine over the cap stays in until room is made."""
    det = OutlierDetector(4, base_ejection_s=10.0)
    assert fail(det, 0, 5, 0.0)
    assert fail(det, 1, 5, 1.0)
    assert not fail(det, 2, 5, 2.0)  # 2 of 4 already out
    assert det.available_mask(2.0).tolist() == [0, 0, 1, 1]
    assert det.ejections_capped_total == 1
    assert det.n_ejected(2.0) == 2
    # Engine 0 comes back at t=10; engine 2's next failure ejects it.
    assert not det.record(2, Outcome.HTTP_5XX, 9.0)
    assert det.record(2, Outcome.HTTP_5XX, 10.0)
    assert det.available_mask(10.0).tolist() == [1, 0, 0, 1]
    assert det.reasons(10.0)[2].startswith("7 consecutive 5xx responses")


def test_cap_applies_per_pool() -> None:
    """With pools, each pool's cap is floor(fraction * its size); a lone engine is never ejected."""
    det = OutlierDetector(5, pool_ids=[0, 0, 1, 1, 2])
    assert fail(det, 0, 5, 0.0)
    assert not fail(det, 1, 5, 0.0)
    assert fail(det, 2, 5, 0.0)
    assert not fail(det, 4, 5, 0.0)
    assert det.available_mask(0.0).tolist() == [0, 1, 0, 1, 1]


def test_random_outcomes_never_break_the_cap(rand: random.Random) -> None:
    """Under random failure bursts the pool cap holds at every step."""
    det = OutlierDetector(10, consecutive_failures=2, base_ejection_s=1.0, max_ejection_s=8.0)
    now_s = 0.0
    for _ in range(20_000):
        now_s += rand.expovariate(100.0)
        e = rand.randrange(10)
        outcome = Outcome.TIMEOUT if rand.random() < 0.6 else Outcome.SUCCESS
        det.record(e, outcome, now_s)
        assert det.n_ejected(now_s) == 10 - int(det.available_mask(now_s).sum()) <= 5
    assert det.ejections_total > 100 and det.ejections_capped_total > 0


def test_mask_feeds_the_selector() -> None:
    """Selector.pick never returns an ejected engine; other keys keep their engine."""
    ids = list(range(1, 9))
    selector = Selector(ids, np.ones((1, 8)))
    det = OutlierDetector(8)
    keys = range(2000)
    before = [selector.pick(k, 0, det.available_mask(0.0)) for k in keys]
    fail(det, 3, 5, 0.0)
    mask = det.available_mask(0.0)
    after = [selector.pick(k, 0, mask) for k in keys]
    assert 3 not in after
    assert all(a == b for a, b in zip(after, before, strict=True) if b != 3)


def test_rebuild_carries_state_over_and_restores_the_cap() -> None:
    """Surviving engines keep streaks and ejections; shrinking the pool ends excess ejections."""
    det = OutlierDetector(4, base_ejection_s=10.0)
    fail(det, 0, 5, 0.0)  # out until 10
    fail(det, 1, 5, 1.0)  # out until 11
    fail(det, 3, 3, 1.0)
    # New set: old 1, a new engine, old 3, old 0 (old 2 removed).
    det.rebuild([1, -1, 3, 0], 2.0)
    assert det.available_mask(2.0).tolist() == [0, 1, 1, 0]
    assert det.failure_streak(2) == 3 and det.failure_streak(1) == 0
    assert det.ejected_until_s(0, 2.0) == 11.0
    # Shrink to the two ejected engines; only one of two may be out, so the ejection
    # ending soonest (old 0's, at 10) ends now.
    det.rebuild([0, 3], 3.0)
    assert det.available_mask(3.0).tolist() == [0, 1]
    assert det.ejected_until_s(0, 3.0) == 11.0
    det.resize(3, 3.0)
    assert det.available_mask(11.0).tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="same old engine"):
        det.rebuild([0, 0], 3.0)
    with pytest.raises(IndexError):
        det.record(3, Outcome.SUCCESS, 3.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"consecutive_failures": 0},
        {"base_ejection_s": 0.0},
        {"max_ejection_s": 1.0},
        {"max_ejected_fraction": 1.5},
        {"failure_kinds": [Outcome.SUCCESS]},
    ],
)
def test_rejects_invalid_parameters(kwargs: dict[str, object]) -> None:
    """Out-of-range parameters are a ValueError naming the parameter."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        OutlierDetector(4, **kwargs)  # type: ignore[arg-type]


def test_version_moves_with_every_availability_change() -> None:
    """version_at() changes on ejection, on expiry and on rebuild, and only then."""
    det = OutlierDetector(4, consecutive_failures=1, base_ejection_s=10.0)
    v0 = det.version_at(0.0)
    det.record(1, Outcome.SUCCESS, 0.0)
    assert det.version_at(0.5) == v0  # nothing changed
    det.record(1, Outcome.CONNECT_ERROR, 1.0)
    v1 = det.version_at(1.0)
    assert v1 != v0 and det.available_mask(1.0)[1] == 0
    assert det.version_at(5.0) == v1  # still ejected
    v2 = det.version_at(11.5)  # the ejection expired
    assert v2 != v1 and det.available_mask(11.5)[1] == 1
    det.resize(5, 12.0)
    assert det.version_at(12.0) != v2
