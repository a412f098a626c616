"""The contract every registered policy keeps, the registry, and the fleet view."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fastroute.config import POLICY_NAMES, PolicyConfig
from fastroute.errors import FastrouteError
from fastroute.hashing import key_hash
from fastroute.policy import (
    DEFAULT_POLICY,
    POLICIES,
    Decision,
    FleetView,
    Policy,
    PolicyConfigError,
    RouteRequest,
    StaticFleetView,
    make_policy,
    policy_params,
)
from fastroute.policy.registry import check_names
from fastroute.tables import FLAG_DRAINING, FLAG_UNAVAILABLE, TableSnapshot

ALL = sorted(POLICIES)


def fresh(name: str, seed: int = 5) -> Policy:
    """A policy instance; randomised ones get a fixed seed."""
    return make_policy(name, seed=seed) if "seed" in policy_params(name) else make_policy(name)


def requests(rand: random.Random, n: int, n_classes: int) -> list[RouteRequest]:
    """Seeded requests with a few shared prompt prefixes."""
    stems = [bytes(rand.getrandbits(8) for _ in range(64)) for _ in range(5)]
    out = []
    for _ in range(n):
        prefix = rand.choice(stems) + str(rand.randrange(50)).encode()
        out.append(
            RouteRequest(
                key_hash=rand.getrandbits(64),
                row=rand.randrange(n_classes),
                prompt_tokens=rand.randrange(1, 4000),
                prefix=prefix if rand.random() < 0.9 else b"",
            )
        )
    return out


def drive(policy: Policy, view: StaticFleetView, reqs: list[RouteRequest], k: int, rand):
    """Route ``reqs`` through ``policy`` with random load changes; return the decisions."""
    decisions = []
    for req in reqs:
        d = policy.choose(req, view, k)
        decisions.append(d)
        if d.ranked:
            policy.on_routed(req, d.engine_ids[0])
            view.loads[d.ranked[0]] += 1
        busy = np.flatnonzero(view.loads)
        if len(busy) and rand.random() < 0.5:
            e = int(rand.choice(list(busy)))
            view.loads[e] -= 1
            policy.on_complete(req, int(view.selector.engine_ids[e]), True)
    return decisions


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_ranked_engines_are_eligible_unique_and_at_most_k(name, k, make_view, rand):
    """Every ranked index is eligible for the row, unique, at most k, with matching ids."""
    view = make_view(12, 4, zero_fraction=0.3, unavailable=(2, 7))
    policy = fresh(name)
    for req, d in zip(
        reqs := requests(rand, 600, 4), drive(policy, view, reqs, k, rand), strict=True
    ):
        assert isinstance(d, Decision) and d.policy == name and d.reason
        eligible = set(np.flatnonzero(view.eligible(req.row)).tolist())
        assert 1 <= len(d.ranked) <= min(k, len(eligible))
        assert len(set(d.ranked)) == len(d.ranked)
        assert set(d.ranked) <= eligible
        assert d.engine_ids == tuple(int(view.selector.engine_ids[i]) for i in d.ranked)
        assert d.chosen == d.ranked[0]
        if d.scores is not None:
            assert len(d.scores) == len(d.ranked)


@pytest.mark.parametrize("name", ALL)
def test_full_ranking_when_enough_engines_are_eligible(name, make_view, rand):
    """With at least k eligible engines the ranking has exactly k entries."""
    view = make_view(8, 2)
    policy = fresh(name)
    for d in drive(policy, view, requests(rand, 100, 2), 3, rand):
        assert len(d.ranked) == 3


@pytest.mark.parametrize("name", ALL)
def test_deterministic_given_the_seed(name, make_view, rand):
    """Two instances with the same seed and inputs make the same decisions."""
    reqs = requests(rand, 400, 3)
    runs = []
    for _ in range(2):
        local = random.Random(99)
        runs.append(drive(fresh(name, seed=3), make_view(9, 3, zero_fraction=0.2), reqs, 3, local))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ALL)
def test_empty_ranking_when_nothing_is_eligible(name, make_view, rand):
    """All engines ejected, or a row of zero weights: no engine, no error."""
    policy = fresh(name)
    req = requests(rand, 1, 2)[0]
    ejected = make_view(6, 2, unavailable=tuple(range(6)))
    d = policy.choose(req, ejected)
    assert d.ranked == () and d.engine_ids == () and d.chosen is None

    weights = np.ones((2, 6))
    weights[1] = 0.0
    zero_row = make_view(6, 2, weights=weights)
    d = policy.choose(RouteRequest(key_hash=req.key_hash, row=1, prefix=b"abc"), zero_row)
    assert d.ranked == () and d.reason == "no-eligible-engine"


@pytest.mark.parametrize("name", ALL)
def test_single_eligible_engine_is_always_chosen(name, make_view, rand):
    """With exactly one eligible engine every request goes there."""
    view = make_view(5, 1, unavailable=(0, 1, 3, 4))
    policy = fresh(name)
    for d in drive(policy, view, requests(rand, 50, 1), 3, rand):
        assert d.ranked == (2,)


@pytest.mark.parametrize("name", ALL)
def test_k_must_be_positive(name, make_view):
    """k = 0 is a caller bug and raises."""
    with pytest.raises(ValueError, match="k must be >= 1"):
        fresh(name).choose(RouteRequest(key_hash=1, row=0), make_view(3, 1), k=0)


@pytest.mark.parametrize("name", ALL)
def test_view_in_flight_is_not_modified(name, make_view, rand):
    """Policies read the load counts, never write them."""
    view = make_view(6, 1)
    view.loads[:] = [3, 0, 7, 1, 1, 2]
    before = view.loads.copy()
    policy = fresh(name)
    for req in requests(rand, 50, 1):
        policy.choose(req, view)
    assert np.array_equal(view.loads, before)


def test_unknown_policy_name_lists_the_valid_ones():
    """A typo in the config names the valid policies."""
    with pytest.raises(PolicyConfigError, match="unknown routing policy 'least-requests'") as e:
        make_policy("least-requests")
    for name in ALL:
        assert name in str(e.value)
    assert isinstance(e.value, FastrouteError) and isinstance(e.value, ValueError)


def test_unknown_parameter_lists_the_valid_ones():
    """A parameter the policy does not take is rejected with the accepted names."""
    with pytest.raises(PolicyConfigError, match="no parameter 'cache_treshold'.*cache_threshold"):
        make_policy("cache-aware", cache_treshold=0.4)
    with pytest.raises(PolicyConfigError, match="valid parameters: none"):
        make_policy("round-robin", seed=1)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("weighted-hrw", {"balance_factor": 0.5}),
        ("weighted-hrw", {"load": "bytes"}),
        ("cache-aware", {"cache_threshold": 1.5}),
        ("cache-aware", {"balance_abs_threshold": -1}),
        ("cache-aware", {"balance_rel_threshold": 0.9}),
        ("cache-aware", {"max_tree_size": 0}),
    ],
)
def test_invalid_tunables_are_rejected(name, params):
    """Out-of-range tunables fail at construction, naming the policy and the value."""
    with pytest.raises(PolicyConfigError, match=name):
        make_policy(name, **params)


def test_registry_names_match_classes_and_default_is_prefix_hrw():
    """POLICIES maps each class's own name to it, for exactly the configuration's names; the
    default is prefix-hrw, the configuration's default."""
    assert DEFAULT_POLICY == "prefix-hrw" == PolicyConfig().default
    assert ALL == sorted(POLICY_NAMES)
    for name, cls in POLICIES.items():
        assert cls.name == name and issubclass(cls, Policy)
        assert isinstance(make_policy(name), cls)
    assert POLICIES["cache-aware"].needs_prefix and POLICIES["prefix-hrw"].needs_prefix
    assert not POLICIES["weighted-hrw"].needs_prefix


def test_static_view_eligibility_combines_weights_and_availability(make_view):
    """eligible(row) is weight > 0 in the row AND available, as uint8, read-only."""
    weights = np.array([[1.0, 0.0, 2.0, 3.0], [0.0, 1.0, 1.0, 1.0]])
    view = make_view(4, 2, weights=weights, unavailable=(3,))
    assert isinstance(view, FleetView)
    assert view.eligible(0).tolist() == [1, 0, 1, 0]
    assert view.eligible(1).tolist() == [0, 1, 1, 0]
    assert view.eligible(0).dtype == np.uint8
    with pytest.raises(ValueError):
        view.eligible(0)[0] = 0
    view.set_available([True, True, False, True])
    assert view.eligible(0).tolist() == [1, 0, 0, 1]
    with pytest.raises(IndexError):
        view.eligible(2)


def test_static_view_from_snapshot_honours_engine_flags():
    """A view over a table snapshot skips unavailable and draining engines."""
    ids = np.array([key_hash(f"e{i}") for i in range(4)], dtype=np.uint64)
    snap = TableSnapshot(
        generation=1,
        engine_ids=ids,
        engine_flags=np.array([0, FLAG_UNAVAILABLE, FLAG_DRAINING, 0], dtype=np.uint8),
        class_keys=np.array([7], dtype=np.uint64),
        weights=np.ones((1, 4)),
        shed_fraction=np.zeros(1),
        retry_ratio=0.1,
        published_at=0.0,
    )
    assert StaticFleetView.from_snapshot(snap).eligible(0).tolist() == [1, 0, 0, 1]
    draining_ok = StaticFleetView.from_snapshot(snap, allow_draining=True)
    assert draining_ok.eligible(0).tolist() == [1, 0, 1, 1]
    d = make_policy("weighted-hrw").choose(RouteRequest(key_hash=5, row=0), draining_ok)
    assert set(d.ranked) <= {0, 2, 3}


def test_decision_encodes_for_the_decision_record(make_view):
    """A decision is a msgspec Struct: it round-trips through JSON unchanged."""
    import msgspec

    view = make_view(5, 1)
    view.loads[:] = [2, 0, 1, 3, 0]
    d = make_policy("least-request").choose(RouteRequest(key_hash=9, row=0), view)
    assert msgspec.json.decode(msgspec.json.encode(d), type=Decision) == d


def test_registry_refuses_names_that_drifted_from_the_configuration():
    """The import-time check fails on a name without a policy or a policy without a name."""
    check_names(POLICIES, POLICY_NAMES)
    with pytest.raises(RuntimeError, match="no policy for \\['new-policy'\\]"):
        check_names(POLICIES, (*POLICY_NAMES, "new-policy"))
    fewer = {k: v for k, v in POLICIES.items() if k != "round-robin"}
    with pytest.raises(RuntimeError, match="no name in the configuration for \\['round-robin'\\]"):
        check_names(POLICIES, tuple(fewer))
