"""round-robin, least-request and power-of-two."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from fastroute.policy import LeastRequest, PowerOfTwo, RoundRobin, RouteRequest


def req(key: int = 1, row: int = 0) -> RouteRequest:
    return RouteRequest(key_hash=key, row=row)


def test_round_robin_is_exactly_fair_over_eligible_engines(make_view, rand):
    """7 eligible engines, 700 requests: each gets exactly 100; ineligible ones none."""
    weights = np.ones((1, 10))
    weights[0, [1, 8]] = 0.0
    view = make_view(10, 1, weights=weights, unavailable=(5,))
    policy = RoundRobin()
    counts = Counter(policy.choose(req(rand.getrandbits(64)), view).chosen for _ in range(700))
    assert counts == {i: 100 for i in (0, 2, 3, 4, 6, 7, 9)}


def test_round_robin_ranks_the_next_engines_in_the_cycle(make_view):
    """ranked = the chosen engine and the next k - 1 of the cycle."""
    view = make_view(5, 1, unavailable=(2,))
    policy = RoundRobin()
    got = [policy.choose(req(), view, k=3).ranked for _ in range(5)]
    assert got == [(0, 1, 3), (1, 3, 4), (3, 4, 0), (4, 0, 1), (0, 1, 3)]


def test_round_robin_cursors_are_per_row(make_view):
    """Requests of one class row do not advance another row's cycle."""
    view = make_view(4, 2)
    policy = RoundRobin()
    assert [policy.choose(req(row=0), view).chosen for _ in range(3)] == [0, 1, 2]
    assert policy.choose(req(row=1), view).chosen == 0
    assert policy.choose(req(row=0), view).chosen == 3
    policy.reset()
    assert policy.choose(req(row=0), view).chosen == 0


def test_least_request_picks_the_minimum(make_view, rand):
    """The chosen engine has the fewest in flight among eligible engines."""
    view = make_view(12, 1, unavailable=(4,))
    policy = LeastRequest()
    for _ in range(500):
        view.loads[:] = [rand.randrange(0, 20) for _ in range(12)]
        view.loads[4] = -1  # ejected: must be skipped even though it looks idle
        d = policy.choose(req(rand.getrandbits(64)), view, k=4)
        eligible = np.flatnonzero(view.eligible(0))
        assert view.loads[d.chosen] == view.loads[eligible].min()
        assert list(d.scores) == [float(view.loads[i]) for i in d.ranked]
        assert list(d.scores) == sorted(d.scores)


def test_least_request_breaks_ties_by_rendezvous_order(make_view, rand):
    """All idle: the pick is the key's rendezvous first choice, so keys stay put."""
    view = make_view(9, 2)
    policy = LeastRequest()
    for key in (rand.getrandbits(64) for _ in range(300)):
        d = policy.choose(req(key, row=1), view, k=3)
        assert list(d.ranked) == view.selector.rank(key, 1, 3)


def test_least_request_ties_only_among_the_least_loaded(make_view):
    """Rendezvous order only decides among engines tied at the minimum."""
    view = make_view(6, 1)
    view.loads[:] = [5, 1, 3, 1, 1, 9]
    key = 4242
    d = LeastRequest().choose(req(key), view, k=5)
    tied = np.zeros(6, dtype=np.uint8)
    tied[[1, 3, 4]] = 1
    assert d.ranked[:3] == tuple(view.selector.rank(key, 0, 3, tied))
    assert d.ranked[3:] == (2, 0)


def test_power_of_two_never_picks_the_busier_sample(make_view, rand):
    """The winner is the less loaded of the two samples drawn from the injected RNG."""
    view = make_view(10, 1, unavailable=(3, 6))
    eligible = [int(i) for i in np.flatnonzero(view.eligible(0))]
    policy = PowerOfTwo(rng=random.Random(77))
    mirror = random.Random(77)
    for _ in range(2000):
        view.loads[:] = [rand.randrange(0, 30) for _ in range(10)]
        a, b = (eligible[i] for i in mirror.sample(range(len(eligible)), 2))
        d = policy.choose(req(rand.getrandbits(64)), view)
        assert {d.ranked[0], d.ranked[1]} == {a, b}
        assert view.loads[d.ranked[0]] <= view.loads[d.ranked[1]]
        assert view.loads[d.chosen] == min(view.loads[a], view.loads[b])
        if view.loads[a] == view.loads[b]:
            assert d.chosen == a
        assert d.scores[:2] == (float(view.loads[d.ranked[0]]), float(view.loads[d.ranked[1]]))


def _simulate(choose, n_engines: int, rand: random.Random, jobs: int = 10_000) -> int:
    """Assign unit jobs; keep about 10 per engine in flight; return the peak max load."""
    loads = np.zeros(n_engines, dtype=np.int64)
    peak = 0
    for _ in range(jobs):
        loads[choose(loads)] += 1
        peak = max(peak, int(loads.max()))
        while loads.sum() > 10 * n_engines:  # a uniformly random in-flight job completes
            loads[rand.choices(range(n_engines), weights=loads.tolist())[0]] -= 1
    return peak


def test_power_of_two_spreads_load(make_view, rand):
    """10k unit jobs with random completions: p2c keeps max load near the mean (10)."""
    n = 20
    view = make_view(n, 1)
    policy = PowerOfTwo(seed=1)

    def p2c(loads):
        view.loads[:] = loads
        return policy.choose(req(rand.getrandbits(64)), view).chosen

    peak = _simulate(p2c, n, random.Random(2))
    assert peak <= 16
    # The bound is meaningful: one uniformly random choice exceeds it on the same workload.
    coin = random.Random(3)
    assert _simulate(lambda loads: coin.randrange(n), n, random.Random(2)) > 16


def test_power_of_two_seed_reproduces_and_reset_rewinds(make_view, rand):
    """Same seed, same picks; reset() restarts the seeded sequence."""
    view = make_view(8, 1)
    a, b = PowerOfTwo(seed=9), PowerOfTwo(seed=9)
    first = [a.choose(req(), view).ranked for _ in range(50)]
    assert first == [b.choose(req(), view).ranked for _ in range(50)]
    a.reset()
    assert first == [a.choose(req(), view).ranked for _ in range(50)]


@pytest.mark.parametrize("k", [1, 2])
def test_power_of_two_short_rankings(make_view, k):
    """k below 3 still puts the winner first."""
    view = make_view(5, 1)
    view.loads[:] = [4, 0, 4, 4, 4]
    policy = PowerOfTwo(seed=4)
    for _ in range(50):
        d = policy.choose(req(), view, k=k)
        assert len(d.ranked) == k and len(d.scores) == k
        if 1 in d.ranked:
            assert d.chosen == 1
