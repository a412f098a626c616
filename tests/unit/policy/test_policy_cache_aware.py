"""cache-aware routing and its approximate prefix tree."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fastroute.policy import CacheAware, RouteRequest, StaticFleetView
from fastroute.policy.prefix_tree import PrefixTree, common_prefix_len


def rbytes(rand: random.Random, n: int, alphabet: bytes = b"abcd") -> bytes:
    return bytes(rand.choice(alphabet) for _ in range(n))


def route(policy: CacheAware, view, prefix: bytes, key: int = 0, row: int = 0):
    """choose + on_routed, as the proxy does; returns the decision."""
    r = RouteRequest(key_hash=key, row=row, prefix=prefix)
    d = policy.choose(r, view)
    policy.on_routed(r, d.engine_ids[0])
    return d


# -- the tree ----------------------------------------------------------------------------


def test_common_prefix_len_matches_a_naive_loop(rand):
    """The XOR trick agrees with a byte-by-byte comparison, offsets included."""
    for _ in range(2000):
        a = rbytes(rand, rand.randrange(0, 40), b"ab")
        b = rbytes(rand, rand.randrange(0, 40), b"ab")
        start = rand.randrange(0, len(b) + 1)
        naive = 0
        while naive < min(len(a), len(b) - start) and a[naive] == b[start + naive]:
            naive += 1
        assert common_prefix_len(a, b, start) == naive


def test_tree_match_returns_each_tenants_longest_prefix():
    """match() reports, per tenant, how many leading bytes it holds."""
    t = PrefixTree(1 << 20)
    t.insert(b"hello world", 1)
    t.insert(b"hello there", 2)
    t.insert(b"help", 3)
    assert t.match(b"hello world, again") == {1: 11, 2: 6, 3: 3}
    assert t.match(b"hello") == {1: 5, 2: 5, 3: 3}
    assert t.match(b"xyz") == {}
    assert t.size(1) == 11 and t.size(2) == 11 and t.size(3) == 4
    t._check()


def test_tree_invariants_hold_under_random_operations(rand):
    """Random inserts, evictions and removals keep sizes, holders and leaf sets exact."""
    t = PrefixTree(300)
    stems = [rbytes(rand, 30) for _ in range(6)]
    for step in range(4000):
        data = rand.choice(stems)[: rand.randrange(0, 31)] + rbytes(rand, rand.randrange(0, 40))
        t.insert(data, rand.randrange(5))
        if step % 500 == 499:
            t.remove_tenant(rand.randrange(5))
        if step % 97 == 0:
            t._check()
    t._check()
    assert all(t.size(x) <= 300 for x in range(5))


def test_tree_size_stays_bounded_under_100k_inserts(rand):
    """100k inserts over 8 engines: every engine's tree stays within max_bytes."""
    bound = 4096
    t = PrefixTree(bound)
    stems = [rand.randbytes(200) for _ in range(50)]
    for _ in range(100_000):
        # Conversation-like: a shared stem cut at a turn boundary, then a new turn.
        data = rand.choice(stems)[: 40 * rand.randrange(1, 6)] + rand.randbytes(24)
        t.insert(data, rand.randrange(8))
    assert max(t.size(x) for x in range(8)) <= bound
    assert min(t.size(x) for x in range(8)) > bound // 2  # it did fill up
    assert t.node_count() <= 8 * bound  # every node holds at least one byte of someone
    t._check()


def test_tree_evicts_least_recently_used_leaves_first():
    """Over the bound, the prefix not used for longest goes; a refreshed one stays."""
    t = PrefixTree(30)
    t.insert(b"A" * 10, 1)
    t.insert(b"B" * 10, 1)
    t.insert(b"C" * 10, 1)
    t.insert(b"A" * 10, 1)  # refresh A
    t.insert(b"D" * 10, 1)  # 40 bytes > 30: evict the LRU leaf, B
    assert t.match(b"B" * 10) == {}
    assert t.match(b"A" * 10) == {1: 10} and t.match(b"C" * 10) == {1: 10}
    assert t.size(1) == 30
    t._check()


def test_tree_eviction_is_per_tenant():
    """One engine over its bound never evicts another engine's prefixes."""
    t = PrefixTree(20)
    t.insert(b"shared-prefix-xx", 2)
    for i in range(50):
        t.insert(b"%02d-engine-one" % i, 1)
    assert t.match(b"shared-prefix-xx") == {2: 16}
    t._check()


def test_tree_remove_tenant_forgets_only_it():
    """remove_tenant drops the engine and prunes nodes nobody holds."""
    t = PrefixTree(1000)
    t.insert(b"abcdef", 1)
    t.insert(b"abcxyz", 2)
    t.remove_tenant(1)
    assert t.match(b"abcdef") == {2: 3}
    assert t.size(1) == 0 and 1 not in t.tenants()
    assert t.node_count() == 2  # "abc" -> "xyz"
    t._check()


# -- the policy ----------------------------------------------------------------------------


def test_same_prefix_goes_to_the_same_engine(make_view, rand):
    """Once routed, a prefix keeps returning to its engine (cache hit)."""
    view = make_view(6, 1)
    policy = CacheAware()
    prompts = [rbytes(rand, 300) for _ in range(20)]
    home = {p: route(policy, view, p, key=i).chosen for i, p in enumerate(prompts)}
    for _ in range(5):
        for p in prompts:
            d = route(policy, view, p, key=rand.getrandbits(64))
            assert d.chosen == home[p] and d.reason == "cache-hit"
            assert d.scores[0] == 1.0


def test_distinct_prefixes_spread_to_the_roomiest_engines(make_view, rand):
    """Unmatched prefixes go to the engine with the smallest tree: one per engine first."""
    view = make_view(5, 1)
    policy = CacheAware()
    chosen = [route(policy, view, rbytes(rand, 100), key=i) for i in range(5)]
    assert sorted(d.chosen for d in chosen) == [0, 1, 2, 3, 4]
    assert all(d.reason == "cache-miss" for d in chosen)


def test_prefixes_sharing_a_long_common_part_follow_each_other(make_view, rand):
    """A conversation growing turn by turn, or a long shared system prompt, stays put."""
    view = make_view(8, 1)
    policy = CacheAware()
    system = rbytes(rand, 400)
    first = route(policy, view, system + b"user: hi", key=1)
    for turn in range(10):
        d = route(policy, view, system + b"user: question %d" % turn, key=100 + turn)
        assert d.chosen == first.chosen and d.reason == "cache-hit"
        assert 0.5 < d.scores[0] < 1.0
    # A short shared part (below cache_threshold) does not attract.
    d = route(policy, view, system[:20] + rbytes(rand, 200), key=7)
    assert d.reason == "cache-miss" and d.chosen != first.chosen


def test_imbalance_switches_to_the_least_loaded_engine(make_view, rand):
    """max - min > 32 and max > 1.0001 * min: load wins over affinity."""
    view = make_view(4, 1)
    policy = CacheAware()
    prompt = rbytes(rand, 200)
    home = route(policy, view, prompt).chosen
    view.loads[:] = 10
    view.loads[home] = 42  # 42 - 10 = 32: not above the threshold yet
    assert route(policy, view, prompt).chosen == home
    view.loads[home] = 43
    others = [i for i in range(4) if i != home]
    view.loads[others[1]] = 9
    d = route(policy, view, prompt)
    assert d.reason == "imbalance" and d.chosen == others[1]
    # The prefix was inserted where it actually went, so both engines now hold it.
    assert policy.tree.match(prompt) == {
        view.selector.engine_ids[home]: 200,
        view.selector.engine_ids[others[1]]: 200,
    }


def test_relative_threshold_also_gates_imbalance(make_view, rand):
    """A large absolute gap that is small relative to the loads is not imbalance."""
    view = make_view(3, 1)
    policy = CacheAware(balance_rel_threshold=1.5)
    prompt = rbytes(rand, 100)
    home = route(policy, view, prompt).chosen
    view.loads[:] = 100
    view.loads[home] = 140  # gap 40 > 32, but 140 < 1.5 * 100
    assert route(policy, view, prompt).reason == "cache-hit"
    view.loads[home] = 151
    assert route(policy, view, prompt).reason == "imbalance"


def test_cache_hit_among_several_holders_prefers_fewer_in_flight(make_view, rand):
    """If several engines hold the prefix, the less busy one serves it."""
    view = make_view(4, 1)
    policy = CacheAware()
    prompt = rbytes(rand, 100)
    ids = view.selector.engine_ids
    policy.tree.insert(prompt, int(ids[0]))
    policy.tree.insert(prompt, int(ids[2]))
    view.loads[:] = [5, 0, 3, 0]
    assert route(policy, view, prompt).chosen == 2
    view.loads[:] = [1, 0, 3, 0]
    assert route(policy, view, prompt).chosen == 0


def test_ineligible_holder_is_skipped(make_view, rand):
    """The engine holding the prefix is ejected: the request goes elsewhere, no error."""
    view = make_view(4, 1)
    policy = CacheAware()
    prompt = rbytes(rand, 100)
    home = route(policy, view, prompt).chosen
    view.set_available([i != home for i in range(4)])
    d = route(policy, view, prompt)
    assert d.chosen != home and d.reason == "cache-miss"


def test_empty_prefix_goes_to_the_least_loaded(make_view):
    """No prefix, nothing to match: least in flight, ties by rendezvous order."""
    view = make_view(5, 1)
    view.loads[:] = [3, 1, 2, 1, 4]
    policy = CacheAware()
    picks = {route(policy, view, b"", key=k).chosen for k in range(200)}
    assert picks == {1, 3}
    assert route(policy, view, b"", key=5).reason == "no-prefix"


def test_max_prefix_bytes_truncates(make_view, rand):
    """Only the first max_prefix_bytes count: differing tails beyond it still hit."""
    view = make_view(4, 1)
    policy = CacheAware(max_prefix_bytes=64)
    head = rbytes(rand, 64)
    home = route(policy, view, head + rbytes(rand, 500)).chosen
    d = route(policy, view, head + rbytes(rand, 500))
    assert d.chosen == home and d.scores[0] == 1.0
    assert policy.tree.size(int(view.selector.engine_ids[home])) == 64


def test_new_table_keeps_history_by_engine_id_and_forgets_removed_engines(make_view, rand):
    """A reordered table keeps affinities; engines that left are dropped from the tree."""
    view = make_view(4, 1)
    policy = CacheAware()
    prompts = [rbytes(rand, 120) for _ in range(8)]
    home = {p: route(policy, view, p).engine_ids[0] for p in prompts}
    ids = [int(x) for x in view.selector.engine_ids]
    gone = ids[1]
    reordered = StaticFleetView([ids[3], ids[0], ids[2]], np.ones((1, 3)))
    for p in prompts:
        d = route(policy, reordered, p)
        if home[p] != gone:
            assert d.engine_ids[0] == home[p]
        assert d.engine_ids[0] != gone
    assert gone not in policy.tree.tenants()
    policy.tree._check()


@pytest.mark.parametrize(("threshold", "reason"), [(0.49, "cache-hit"), (0.5, "cache-miss")])
def test_cache_threshold_is_strict(make_view, threshold, reason, rand):
    """Affinity needs match fraction > cache_threshold: exactly half a match at 0.5 misses."""
    view = make_view(3, 1)
    policy = CacheAware(cache_threshold=threshold)
    a = rbytes(rand, 100)
    route(policy, view, a)
    d = route(policy, view, a[:50] + rbytes(rand, 50, b"xyz"))  # differs from byte 50 on
    assert d.scores[0] == (0.5 if reason == "cache-hit" else 0.0)
    assert d.reason == reason
