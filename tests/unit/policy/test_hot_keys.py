"""Decayed key shares: the estimate, its decay, hysteresis and the memory bound."""

from __future__ import annotations

import pytest

from fastroute._core import HotKeys


def test_shares_follow_the_observed_weight() -> None:
    hot = HotKeys(half_life_requests=1e9)  # no decay within the test
    for i in range(100):
        hot.observe([1, 2] if i % 4 == 0 else [1, 3 + i], 10.0)
    assert hot.share(1) == pytest.approx(1.0)
    assert hot.share(2) == pytest.approx(0.25)
    assert hot.share(999) == 0.0
    assert hot.requests == 100


def test_old_observations_count_half_per_half_life() -> None:
    hot = HotKeys(half_life_requests=10)
    hot.observe([7], 1.0)
    for i in range(10):
        hot.observe([100 + i], 1.0)
    # key 7: 0.5 left of its weight; the total is a geometric sum of 11 halvings.
    total = sum(0.5 ** (j / 10) for j in range(11))
    assert hot.share(7) == pytest.approx(0.5 / total)


def test_a_group_near_the_threshold_does_not_flip() -> None:
    hot = HotKeys(half_life_requests=1e9)
    for i in range(100):
        hot.observe([1] if i % 5 == 0 else [1000 + i], 1.0)  # key 1 at share 0.2
    assert not hot.is_hot(1, 0.25, 0.125)
    for _ in range(40):
        hot.observe([1], 1.0)  # share (20 + 40) / 140 = 0.43
    assert hot.is_hot(1, 0.25, 0.125)
    for i in range(200):
        hot.observe([5000 + i], 1.0)  # share 60 / 340 = 0.18: below entry, above exit
    assert hot.is_hot(1, 0.25, 0.125)
    for i in range(200):
        hot.observe([9000 + i], 1.0)  # 60 / 540 = 0.11: below the exit share
    assert not hot.is_hot(1, 0.25, 0.125)


def test_memory_is_bounded_and_hot_keys_survive_pruning() -> None:
    hot = HotKeys(half_life_requests=500, max_keys=64)
    for i in range(5000):
        hot.observe([1, 10_000 + i], 1.0)
        assert len(hot) <= 65
    assert hot.share(1) == pytest.approx(1.0)
    hot.reset()
    assert len(hot) == 0 and hot.share(1) == 0.0


def test_bad_parameters_raise() -> None:
    with pytest.raises(ValueError, match="half_life"):
        HotKeys(0)
    with pytest.raises(ValueError, match="max_keys"):
        HotKeys(10, max_keys=4)
