"""Exact aggregation: grouping keys, capacity sums and the proportional split."""

from __future__ import annotations

import numpy as np
import pytest

from controller.groups import group_engines, regroup_rates, split_group
from controller.latency import LatencyProfile


def test_split_group_is_proportional_to_effective_capacity() -> None:
    """Members receive x · C_i h_i / Σ C_j h_j; a capacity-less group gets nothing."""
    out = split_group([10.0, 4.0], [8.0, 12.0, 0.0, 20.0])
    assert np.allclose(out[0], [2.0, 3.0, 0.0, 5.0])
    assert np.allclose(out.sum(axis=1), [10.0, 4.0])
    assert np.array_equal(split_group([1.0], [0.0, 0.0]), np.zeros((1, 2)))
    with pytest.raises(ValueError):
        split_group([1.0], [-1.0])


def test_engines_group_by_shape_distance_and_eligibility() -> None:
    """Same shape + same RTT row + same eligibility ⇒ one group; health keeps membership."""
    a = LatencyProfile.seed(0.1, 0.01)
    a_copy = LatencyProfile.seed(0.1, 0.01)  # equal shape, distinct object
    b = LatencyProfile.seed(0.3, 0.01)
    profiles = [a, a_copy, a, b, a, a]
    cap = np.array([8.0, 12.0, 20.0, 8.0, 8.0, 8.0])
    health = np.array([1.0, 0.5, 1.0, 1.0, 0.0, 1.0])
    rtt = np.array([[0.01, 0.01, 0.01, 0.01, 0.01, 0.09], [0.05] * 6])
    elig = np.ones((2, 6), dtype=bool)
    elig[1, 2] = False
    groups = group_engines(profiles, cap, elig, rtt, health=health)
    # {0, 1, 4} (4 is failed but still a member), {2} (eligibility), {3} (shape), {5} (distance)
    assert [m.tolist() for m in groups.members] == [[0, 1, 4], [2], [3], [5]]
    assert np.allclose(groups.capacity_rps, [8.0 + 6.0 + 0.0, 20.0, 8.0, 8.0])
    assert groups.profiles[2] is b
    assert groups.eligible.tolist() == [[True] * 4, [True, False, True, True]]
    x = groups.split(np.array([[14.0, 1.0, 0.0, 2.0], [7.0, 0.0, 0.0, 0.0]]))
    assert np.allclose(x[0], [8.0, 6.0, 1.0, 0.0, 0.0, 2.0])
    assert np.allclose(x[1], [4.0, 3.0, 0.0, 0.0, 0.0, 0.0])


def test_regroup_rates_keeps_class_totals_across_a_split() -> None:
    """Rates over old groups, re-expressed over a partition where one engine left its group,
    keep each class total and follow the capacity split."""
    a, b = LatencyProfile.seed(0.05, 0.005), LatencyProfile.seed(0.1, 0.01)
    cap = np.array([10.0, 30.0, 20.0])
    elig = np.ones((2, 3), dtype=bool)
    dist = np.zeros((2, 3))
    old = group_engines([a, a, a], cap, elig, dist)
    new = group_engines([a, b, a], cap, elig, dist)
    assert (old.n_groups, new.n_groups) == (1, 2)
    x = np.array([[6.0], [12.0]])
    out = regroup_rates(x, old, new)
    np.testing.assert_allclose(out.sum(axis=1), [6.0, 12.0])
    g_b = int(new.group_of_engine[1])
    np.testing.assert_allclose(out[:, g_b], [3.0, 6.0])  # engine 1 held half the capacity
    with pytest.raises(ValueError, match="same engines"):
        regroup_rates(x, old, group_engines([a, a], cap[:2], elig[:, :2], dist[:, :2]))


def _random_fleet(seed: int) -> tuple[list[LatencyProfile], np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = [LatencyProfile.seed(0.1, 0.01), LatencyProfile.seed(0.05, 0.006)]
    n_e, n_g = 40, 6
    region = rng.integers(0, 4, n_e)
    profiles = [shapes[i % 2] for i in range(n_e)]
    cap = rng.choice([8.0, 12.0], n_e)
    elig = rng.random((n_g, 4))[:, region] < 0.7
    dist = rng.uniform(0.002, 0.1, (n_g, 4))[:, region]
    return profiles, cap, elig, dist


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_with_health_equals_a_full_regroup(seed: int) -> None:
    profiles, cap, elig, dist = _random_fleet(seed)
    before = group_engines(profiles, cap, elig, dist)
    health = np.where(np.random.default_rng(seed).random(cap.size) < 0.3, 0.5, 1.0)
    health[0] = 0.0
    full = group_engines(profiles, cap, elig, dist, health=health)
    fast = before.with_health(cap, health)
    np.testing.assert_array_equal(fast.group_of_engine, full.group_of_engine)
    np.testing.assert_array_equal(fast.engine_capacity_rps, full.engine_capacity_rps)
    np.testing.assert_allclose(fast.capacity_rps, full.capacity_rps, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(fast.eligible, full.eligible)
    np.testing.assert_array_equal(fast.network_latency_s, full.network_latency_s)
    assert all(a is b for a, b in zip(fast.profiles, full.profiles, strict=True))


def test_with_health_rejects_bad_health() -> None:
    profiles, cap, elig, dist = _random_fleet(1)
    groups = group_engines(profiles, cap, elig, dist)
    with pytest.raises(ValueError, match="health within"):
        groups.with_health(cap, np.full(cap.size, 1.5))
    with pytest.raises(ValueError, match="40 engines"):
        groups.with_health(cap[:-1], np.ones(cap.size - 1))


def _reference_partition(profiles, elig, dist) -> np.ndarray:
    """The previous implementation's key: one float row [shape id, bits, distances] per engine."""
    shape_ids: dict[tuple[float, ...], int] = {}
    shape = np.array([shape_ids.setdefault(p.shape_key(9), len(shape_ids)) for p in profiles])
    rows = np.column_stack([shape, elig.T.astype(float), np.round(np.where(elig, dist, 0).T, 9)])
    index: dict[bytes, int] = {}
    return np.array([index.setdefault((r + 0.0).tobytes(), len(index)) for r in rows])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_refit_with_kept_locations_equals_a_full_regroup(seed: int) -> None:
    profiles, cap, elig, dist = _random_fleet(seed)
    before = group_engines(profiles, cap, elig, dist)
    np.testing.assert_array_equal(
        before.group_of_engine, _reference_partition(profiles, elig, dist)
    )
    refit = list(profiles)
    odd = LatencyProfile.seed(0.2, 0.02)
    for i in np.random.default_rng(seed).choice(cap.size, 5, replace=False):
        refit[i] = odd
    full = group_engines(refit, cap, elig, dist)
    kept = group_engines(refit, cap, elig, dist, location_of_engine=before.location_of_engine)
    np.testing.assert_array_equal(kept.group_of_engine, full.group_of_engine)
    np.testing.assert_array_equal(full.group_of_engine, _reference_partition(refit, elig, dist))
    assert all(a is b for a, b in zip(kept.profiles, full.profiles, strict=True))
    with pytest.raises(ValueError, match="location_of_engine"):
        group_engines(refit, cap, elig, dist, location_of_engine=np.zeros(3, dtype=int))
