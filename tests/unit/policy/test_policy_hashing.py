"""weighted-hrw (with and without the bounded-load guard) and consistent-hash."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from fastroute._core import Selector
from fastroute.policy import ConsistentHash, RouteRequest, WeightedHRW


def keys(rand, n):
    return [rand.getrandbits(64) for _ in range(n)]


def test_weighted_hrw_equals_selector_rank(make_view, rand):
    """Without the guard the ranking is exactly Selector.rank over the eligible mask."""
    view = make_view(30, 4, zero_fraction=0.25, unavailable=(1, 9, 17))
    policy = WeightedHRW()
    for key in keys(rand, 2000):
        row = key % 4
        d = policy.choose(RouteRequest(key_hash=key, row=row), view, k=3)
        assert list(d.ranked) == view.selector.rank(key, row, 3, view.eligible(row))
        assert d.reason == "hrw" and d.scores is None


def test_weighted_hrw_never_picks_zero_weight_or_ejected_engines(make_view, rand):
    """Zero weights and ejected engines are absent from every ranking."""
    weights = np.ones((1, 8))
    weights[0, [0, 5]] = 0.0
    view = make_view(8, 1, weights=weights, unavailable=(3,))
    policy = WeightedHRW()
    seen = Counter()
    for key in keys(rand, 5000):
        seen.update(policy.choose(RouteRequest(key_hash=key, row=0), view, k=5).ranked)
    assert set(seen) == {1, 2, 4, 6, 7}


def test_weighted_hrw_shares_follow_weights(make_view, rand):
    """Engine shares of 40k keys match the weight shares within sampling noise."""
    weights = np.array([[1.0, 2.0, 3.0, 4.0]])
    view = make_view(4, 1, weights=weights)
    counts = Counter(
        WeightedHRW().choose(RouteRequest(key_hash=k, row=0), view).chosen
        for k in keys(rand, 40_000)
    )
    for i, w in enumerate(weights[0]):
        assert abs(counts[i] / 40_000 - w / 10) < 0.01


def test_ejecting_an_engine_moves_only_its_keys_to_their_runner_up(make_view, rand):
    """Ejection moves exactly the ejected engine's keys, each to its second choice."""
    view = make_view(12, 1)
    policy = WeightedHRW()
    ks = keys(rand, 5000)
    before = [policy.choose(RouteRequest(key_hash=k, row=0), view).ranked for k in ks]
    view.set_available([i != 4 for i in range(12)])
    for k, old in zip(ks, before, strict=True):
        new = policy.choose(RouteRequest(key_hash=k, row=0), view).chosen
        assert new == (old[1] if old[0] == 4 else old[0])


def test_bounded_load_spills_an_overloaded_first_choice(make_view):
    """An engine over c times its fair share loses the pick to the next in its ranking."""
    view = make_view(6, 1, weights=np.ones((1, 6)))
    policy = WeightedHRW(balance_factor=2.0)
    req = RouteRequest(key_hash=0xDEADBEEF, row=0)
    natural = view.selector.rank(req.key_hash, 0, 6)
    d = policy.choose(req, view)
    assert d.ranked == tuple(natural[:3]) and d.reason == "hrw"

    view.loads[natural[0]] = 10  # total 10: bound 2 * 11 / 6 = 3.7 per engine
    d = policy.choose(req, view)
    assert d.reason == "bounded-spill"
    assert d.chosen == natural[1]
    assert d.chosen == view.selector.pick_bounded(req.key_hash, 0, view.loads, 2.0)
    assert d.ranked == (natural[1], natural[0], natural[2])  # chosen first, the rest in order


def test_bounded_load_caps_a_hot_key(make_view):
    """10k requests of one key spread so that no engine exceeds its weighted bound + 1."""
    c = 2.0
    weights = np.array([[1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]])
    view = make_view(8, 1, weights=weights)
    policy = WeightedHRW(balance_factor=c)
    req = RouteRequest(key_hash=12345, row=0)
    spills = 0
    for _ in range(10_000):
        d = policy.choose(req, view)
        spills += d.reason == "bounded-spill"
        view.loads[d.chosen] += 1
    assert spills > 0
    # Each assignment satisfied load_e + 1 <= c * (total + 1) * w_e / W when it was made.
    share = weights[0] / weights[0].sum()
    assert np.all(view.loads <= np.ceil(c * 10_000 * share) + 1)
    # Unguarded, the hot key would sit on one engine.
    unguarded = make_view(8, 1, weights=weights)
    for _ in range(100):
        unguarded.loads[WeightedHRW().choose(req, unguarded).chosen] += 1
    assert unguarded.loads.max() == 100


def test_bounded_load_on_tokens_uses_token_counts(make_view):
    """load='tokens' reads in_flight_tokens, not request counts."""
    view = make_view(4, 1, weights=np.ones((1, 4)))
    req = RouteRequest(key_hash=777, row=0)
    first = view.selector.pick(req.key_hash, 0)
    view.token_loads[first] = 100_000
    assert WeightedHRW(balance_factor=2.0, load="tokens").choose(req, view).chosen != first
    assert WeightedHRW(balance_factor=2.0, load="requests").choose(req, view).chosen == first


def test_consistent_hash_same_key_same_engine(make_view, rand):
    """A key maps to the same engine on every call and in a fresh instance."""
    view = make_view(10, 2)
    a, b = ConsistentHash(), ConsistentHash()
    for key in keys(rand, 1000):
        req = RouteRequest(key_hash=key, row=1)
        assert a.choose(req, view) == a.choose(req, view) == b.choose(req, view)


def test_consistent_hash_ignores_weight_values(make_view, rand):
    """Skewed weights do not change consistent-hash picks, and shares are uniform."""
    skewed = np.array([[1.0, 10.0, 100.0, 1000.0, 1.0]])
    a = make_view(5, 1, weights=skewed)
    b = make_view(5, 1, weights=np.ones((1, 5)))
    policy, hrw = ConsistentHash(), WeightedHRW()
    counts = Counter()
    for key in keys(rand, 20_000):
        req = RouteRequest(key_hash=key, row=0)
        d = policy.choose(req, a)
        assert d.ranked == policy.choose(req, b).ranked
        assert d.ranked == hrw.choose(req, b).ranked  # = HRW on an all-equal row
        counts[d.chosen] += 1
    for i in range(5):
        assert abs(counts[i] / 20_000 - 0.2) < 0.015


def test_consistent_hash_respects_eligibility(make_view, rand):
    """Zero-weight and ejected engines are never ranked."""
    weights = np.ones((1, 6))
    weights[0, 2] = 0.0
    view = make_view(6, 1, weights=weights, unavailable=(4,))
    policy = ConsistentHash()
    for key in keys(rand, 2000):
        assert not {2, 4} & set(policy.choose(RouteRequest(key_hash=key, row=0), view, 4).ranked)


def test_consistent_hash_removal_moves_only_that_engines_keys(make_view, rand):
    """Removing an engine from the table moves only its keys, by engine id not index."""
    full = make_view(10, 1)
    policy = ConsistentHash()
    ks = keys(rand, 5000)
    before = {k: policy.choose(RouteRequest(key_hash=k, row=0), full).engine_ids for k in ks}
    removed = int(full.selector.engine_ids[3])
    # A new table without engine 3: every later index shifts down by one.
    ids = [int(e) for e in full.selector.engine_ids if int(e) != removed]
    from fastroute.policy import StaticFleetView

    smaller = StaticFleetView(ids, np.ones((1, 9)))
    moved = 0
    for k in ks:
        now = policy.choose(RouteRequest(key_hash=k, row=0), smaller).engine_ids[0]
        old = before[k]
        if old[0] == removed:
            assert now == old[1]
            moved += 1
        else:
            assert now == old[0]
    assert math.isclose(moved / len(ks), 0.1, abs_tol=0.02)


@pytest.mark.parametrize("policy", [WeightedHRW(), ConsistentHash()], ids=["hrw", "ch"])
def test_hash_policies_agree_across_instances(policy, make_view, rand):
    """Stateless: decisions do not depend on history (the proxy's workers agree)."""
    view = make_view(7, 1)
    ks = keys(rand, 300)
    first = [policy.choose(RouteRequest(key_hash=k, row=0), view) for k in ks]
    second = [type(policy)().choose(RouteRequest(key_hash=k, row=0), view) for k in reversed(ks)]
    assert first == second[::-1]


def test_selector_is_reused_for_unweighted_table(make_view):
    """consistent-hash builds its ones-table once per table, not per request."""
    view = make_view(5, 1)
    policy = ConsistentHash()
    policy.choose(RouteRequest(key_hash=1, row=0), view)
    built = policy._ones
    policy.choose(RouteRequest(key_hash=2, row=0), view)
    assert policy._ones is built and isinstance(built, type(Selector([1], [[1.0]])))
