"""Retry budget: Finagle-style token bucket, simulated with a fake clock."""

from __future__ import annotations

import random

import pytest

from fastroute.guards.retry_budget import RetryBudget


def simulate(
    budget: RetryBudget, failure_p: float, rate_rps: float, duration_s: float, rng: random.Random
) -> float:
    """Offer ``rate_rps`` requests/s, each attempt failing with ``failure_p``; return
    attempts per original request. Retries go out at once (no backoff), the worst case."""
    n = int(rate_rps * duration_s)
    attempts = 0
    for i in range(n):
        now_s = i / rate_rps
        budget.deposit(now_s)
        attempts += 1
        attempt = 0
        while rng.random() < failure_p and budget.may_retry(attempt, now_s):
            attempt += 1
            attempts += 1
    return attempts / n


@pytest.mark.parametrize(
    ("failure_p", "expected"),
    [(0.05, 1.05), (0.5, 1.102), (1.0, 1.102)],
    ids=["5%-failing", "50%-failing", "100%-failing"],
)
def test_amplification_is_bounded_by_ratio_plus_floor(
    rand: random.Random, failure_p: float, expected: float
) -> None:
    """At 1000 req/s, ratio 0.1, floor 2/s: attempts/request <= 1 + ratio + floor/rate (1.102)."""
    budget = RetryBudget(ratio=0.1, min_retries_per_s=2.0, ttl_s=10.0, max_retries=1)
    measured = simulate(budget, failure_p, rate_rps=1000.0, duration_s=60.0, rng=rand)
    bound = 1.0 + 0.1 + 2.0 / 1000.0
    assert measured <= bound + 1e-9
    # docs/algorithms.md §3 derives 1.050 / 1.102 / 1.102; binomial noise at 5 % over 60 k
    # requests is ±0.0009 (1 sigma), so 0.003 is > 3 sigma.
    assert measured == pytest.approx(expected, abs=0.003)
    if failure_p == 0.05:
        assert budget.retries_refused_total == 0  # the budget does not bind: all retried
    else:
        assert budget.retries_refused_total > 0
    assert budget.deposits_total == 60_000


def test_floor_lets_a_quiet_class_retry() -> None:
    """At 10 req/s every failure may retry up to the floor: 1 + 0.1 + 2/10 = 1.3."""
    budget = RetryBudget(ratio=0.1, min_retries_per_s=2.0, ttl_s=10.0)
    measured = simulate(budget, 1.0, rate_rps=10.0, duration_s=600.0, rng=random.Random(0))
    assert measured == pytest.approx(1.3, abs=1e-9)


def test_budget_refills_after_ttl() -> None:
    """Deposits and withdrawals expire ttl_s later, and the budget is whole again."""
    budget = RetryBudget(ratio=0.1, min_retries_per_s=2.0, ttl_s=10.0)
    for _ in range(100):
        budget.deposit(0.0)
    allowed = sum(budget.try_withdraw(0.5) for _ in range(50))
    assert allowed == 20 + 10  # reserve 2/s * 10 s + 0.1 * 100 deposits
    assert not budget.try_withdraw(9.99)  # still inside the window
    assert budget.balance(10.0) == pytest.approx(20.0)  # deposits and retries expired
    assert sum(budget.try_withdraw(10.0) for _ in range(50)) == 20
    assert budget.retries_allowed_total == 50
    assert budget.retries_refused_total == 20 + 1 + 30


def test_memory_stays_bounded_across_long_gaps() -> None:
    """A jump of many ttls clears the window at once; a clock that steps back expires nothing."""
    budget = RetryBudget(ratio=1.0, min_retries_per_s=0.0, ttl_s=10.0)
    budget.deposit(5.0)
    assert budget.balance(4.0) == pytest.approx(1.0)  # clock stepped back: still counted
    assert budget.balance(1e9) == 0.0
    budget.deposit(1e9)
    assert budget.balance(1e9 + 9.0) == pytest.approx(1.0)


def test_ratio_change_takes_effect_at_once() -> None:
    """set_ratio re-prices tokens already deposited, both ways."""
    budget = RetryBudget(ratio=0.1, min_retries_per_s=0.0, ttl_s=10.0)
    for _ in range(1000):
        budget.deposit(0.0)
    assert budget.balance(0.0) == pytest.approx(100.0)
    budget.set_ratio(0.02)
    assert sum(budget.try_withdraw(1.0) for _ in range(100)) == 20
    budget.set_ratio(0.1)
    assert budget.ratio == 0.1
    assert sum(budget.try_withdraw(1.0) for _ in range(100)) == 80
    budget.set_ratio(0.0)
    assert not budget.try_withdraw(1.0)


def test_may_retry_counts_attempts_against_max_retries() -> None:
    """Only attempts below max_retries may retry; the refusal does not touch the budget."""
    budget = RetryBudget(ratio=1.0, min_retries_per_s=10.0, max_retries=1)
    assert budget.may_retry(0, 0.0)
    assert not budget.may_retry(1, 0.0)
    assert budget.retries_allowed_total == 1 and budget.retries_refused_total == 0
    assert not RetryBudget(max_retries=0).may_retry(0, 0.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio": -0.1},
        {"ratio": float("nan")},
        {"min_retries_per_s": -1.0},
        {"ttl_s": 0.5},
        {"slot_s": 0.0},
        {"max_retries": -1},
    ],
)
def test_rejects_invalid_parameters(kwargs: dict[str, float]) -> None:
    """Out-of-range parameters are a ValueError naming the parameter."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RetryBudget(**kwargs)  # type: ignore[arg-type]
