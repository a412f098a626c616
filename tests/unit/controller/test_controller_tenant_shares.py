"""Water-filling of tenant limits over proxies and weighted max-min inside a priority."""

from __future__ import annotations

import random

import pytest

from controller.tenant_shares import shed_fractions, split_limit, weighted_max_min


def test_split_80_20_over_limit_gives_each_proxy_its_fair_level() -> None:
    # 600 req/min fleet-wide, demand 960 + 240: the small proxy is below the fair
    # level (300), so it keeps all its demand and the rest flows to the big one.
    shares = split_limit(600, {"p1": 960, "p2": 240})
    assert shares == pytest.approx({"p1": 360, "p2": 240})


def test_split_both_over_fair_level_is_even() -> None:
    assert split_limit(600, {"p1": 960, "p2": 400}) == pytest.approx({"p1": 300, "p2": 300})


def test_split_under_limit_spreads_the_spare_evenly() -> None:
    shares = split_limit(600, {"p1": 100, "p2": 0})
    assert shares == pytest.approx({"p1": 350, "p2": 250})
    assert split_limit(600, {"p1": 0, "p2": 0}) == pytest.approx({"p1": 300, "p2": 300})


def test_split_properties_hold_on_random_demands() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 8)
        demands = {f"p{i}": rng.choice([0.0, rng.uniform(0, 1000)]) for i in range(n)}
        limit = rng.uniform(0, 2000)
        shares = split_limit(limit, demands)
        assert sum(shares.values()) == pytest.approx(limit, rel=1e-9, abs=1e-6)
        alloc = weighted_max_min(limit, demands)
        assert sum(alloc.values()) == pytest.approx(min(limit, sum(demands.values())), abs=1e-6)
        # max-min: a proxy held below its demand gets at least every other's allocation
        for k, a in alloc.items():
            assert a <= demands[k] + 1e-9
            if a < demands[k] - 1e-6:
                assert all(a >= other - 1e-6 for other in alloc.values())


def test_weighted_max_min_two_to_one_when_both_over() -> None:
    alloc = weighted_max_min(300, {"a": 600, "b": 600}, {"a": 2, "b": 1})
    assert alloc == pytest.approx({"a": 200, "b": 100})


def test_weighted_max_min_small_demand_is_served_whole() -> None:
    alloc = weighted_max_min(300, {"a": 600, "b": 50}, {"a": 1, "b": 3})
    assert alloc == pytest.approx({"a": 250, "b": 50})


def test_weighted_max_min_random_weights_are_proportional_among_the_held_back() -> None:
    rng = random.Random(11)
    for _ in range(300):
        n = rng.randint(1, 6)
        demands = {f"t{i}": rng.uniform(0, 500) for i in range(n)}
        weights = {k: rng.uniform(0.1, 5) for k in demands}
        cap = rng.uniform(0, 1500)
        alloc = weighted_max_min(cap, demands, weights)
        held = [k for k in alloc if alloc[k] < demands[k] - 1e-6]
        ratios = [alloc[k] / weights[k] for k in held]
        if ratios:
            assert max(ratios) == pytest.approx(min(ratios), rel=1e-6)
            # the held back get at least the weighted level of any satisfied tenant
            assert all(alloc[k] / weights[k] <= ratios[0] + 1e-6 for k in alloc)


def test_shed_fractions_follow_the_weights() -> None:
    f = shed_fractions(300, {"a": 600, "b": 600}, {"a": 2, "b": 1})
    assert f == pytest.approx({"a": 1 - 200 / 600, "b": 1 - 100 / 600})


@pytest.mark.parametrize(
    ("cap", "demands", "weights"),
    [(-1, {"a": 1}, None), (1, {"a": -1}, None), (1, {"a": 1}, {"a": 0}), (float("nan"), {}, None)],
)
def test_bad_input_is_refused(cap: float, demands: dict, weights: dict | None) -> None:
    with pytest.raises(ValueError, match="must be"):
        weighted_max_min(cap, demands, weights)
