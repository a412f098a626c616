"""Weighted rendezvous selector: golden vectors, compiled/pure parity, statistical properties.

Tests parametrised with ``impl`` run against every implementation present (``py``
always, ``cy`` when the extension is built): the spec and the compiled core must
behave identically. Module-level ``parity`` marker: the suite is re-run with
``FASTROUTE_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from fastroute import _core
from fastroute._core.selector_py import engine_seed, mix64, unit_open
from fastroute.hashing import engine_id, key_hash

pytestmark = pytest.mark.parity

IMPLS = {"py": _core.SelectorPy}
if _core.SelectorC is not None:
    IMPLS["cy"] = _core.SelectorC


@pytest.fixture(params=sorted(IMPLS), ids=sorted(IMPLS))
def impl(request: pytest.FixtureRequest) -> type:
    return IMPLS[request.param]


NAMES = ["engine-a", "engine-b", "engine-c", "engine-d", "engine-e"]
IDS = [engine_id(n) for n in NAMES]
GOLDEN_WEIGHTS = [[1, 1, 1, 1, 1], [1, 2, 3, 4, 0]]
# key "session-i" -> (pick in row 0, pick in row 1, rank(row 1, k=3)).
# Changing any of these changes where every deployed session goes: a breaking change.
GOLDEN = {
    0: ("engine-b", "engine-d", ["engine-d", "engine-c", "engine-b"]),
    1: ("engine-d", "engine-d", ["engine-d", "engine-c", "engine-b"]),
    2: ("engine-a", "engine-d", ["engine-d", "engine-a", "engine-b"]),
    3: ("engine-c", "engine-c", ["engine-c", "engine-d", "engine-b"]),
    4: ("engine-d", "engine-d", ["engine-d", "engine-b", "engine-c"]),
    5: ("engine-a", "engine-d", ["engine-d", "engine-a", "engine-b"]),
    6: ("engine-a", "engine-a", ["engine-a", "engine-d", "engine-c"]),
    7: ("engine-c", "engine-c", ["engine-c", "engine-d", "engine-b"]),
    8: ("engine-b", "engine-b", ["engine-b", "engine-d", "engine-c"]),
    9: ("engine-c", "engine-c", ["engine-c", "engine-d", "engine-a"]),
}


def _keys(rand, n: int) -> list[int]:
    return [int(x) for x in rand.np.integers(0, 2**64, size=n, dtype=np.uint64)]


# -- golden vectors -------------------------------------------------------------------


def test_mix64_matches_splitmix64_reference() -> None:
    """mix64 is the splitmix64 finaliser: its first output from seed 0 is the published one."""
    assert mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    assert engine_seed(0) == 0xE220A8397B1DCDAF


def test_unit_open_stays_inside_the_open_interval() -> None:
    """u is never 0 or 1, so -ln(u) is finite and positive."""
    assert 0.0 < unit_open(0) < 1.0
    assert 0.0 < unit_open(2**64 - 1) < 1.0
    assert unit_open(2**64 - 1) == 1.0 - 2**-53
    assert unit_open(0) == 2**-53
    assert unit_open(2**63) == 0.5 + 2**-53


def test_golden_vectors(impl: type) -> None:
    """Fixed names, weights and keys give the recorded picks and failover order."""
    selector = impl(IDS, GOLDEN_WEIGHTS)
    for i, (row0, row1, ranked) in GOLDEN.items():
        k = key_hash(f"session-{i}")
        assert NAMES[selector.pick(k, 0)] == row0
        assert NAMES[selector.pick(k, 1)] == row1
        assert [NAMES[j] for j in selector.rank(k, 1, 3)] == ranked


def test_zero_weight_engine_is_never_picked(impl: type) -> None:
    """engine-e has weight 0 in row 1: never picked, never ranked."""
    selector = impl(IDS, GOLDEN_WEIGHTS)
    for i in range(2000):
        k = key_hash(f"k{i}")
        assert selector.pick(k, 1) != 4
        assert 4 not in selector.rank(k, 1, 5)


# -- API edges ---------------------------------------------------------------------------


def test_no_eligible_engine_returns_minus_one(impl: type) -> None:
    """All-zero rows, all-unavailable masks and empty tables give -1 / []."""
    selector = impl([1, 2, 3], [[0, 0, 0], [1, 1, 1]])
    assert selector.pick(123, 0) == -1
    assert selector.rank(123, 0, 3) == []
    assert selector.pick(123, 1, np.zeros(3, dtype=np.uint8)) == -1
    assert selector.pick_bounded(123, 0, np.zeros(3, dtype=np.int64)) == -1
    empty = impl([], np.zeros((1, 0)))
    assert empty.pick(1, 0) == -1 and empty.rank(1, 0, 3) == []


def test_bad_arguments_raise_the_same_errors(impl: type) -> None:
    """Invalid rows, keys, masks, k and weights raise specific errors in both implementations."""
    selector = impl([1, 2, 3], [[1, 1, 1]])
    with pytest.raises(IndexError):
        selector.pick(1, 1)
    with pytest.raises(IndexError):
        selector.rank(1, -1, 2)
    with pytest.raises(OverflowError):
        selector.pick(-1, 0)
    with pytest.raises(OverflowError):
        selector.pick(2**64, 0)
    with pytest.raises(ValueError, match="k must be"):
        selector.rank(1, 0, 0)
    with pytest.raises(ValueError, match="available"):
        selector.pick(1, 0, np.ones(2, dtype=np.uint8))
    with pytest.raises(ValueError, match="balance_factor"):
        selector.pick_bounded(1, 0, np.zeros(3, dtype=np.int64), 0.5)
    with pytest.raises(ValueError, match="loads"):
        selector.pick_bounded(1, 0, np.zeros(2, dtype=np.int64))
    for weights, message in [
        ([[1, -1, 1]], "non-negative"),
        ([[1, math.nan, 1]], "finite"),
        ([[1, math.inf, 1]], "finite"),
        ([1, 1, 1], "2-D"),
        ([[1, 1]], "columns"),
    ]:
        with pytest.raises(ValueError, match=message):
            impl([1, 2, 3], weights)
    with pytest.raises(ValueError, match="unique"):
        impl([1, 1, 3], [[1, 1, 1]])


def test_rank_is_capped_and_first_equals_pick(impl: type, rand) -> None:
    """rank(k > n) returns every eligible engine; rank()[0] is pick()."""
    selector = impl(list(range(7)), rand.np.random((2, 7)))
    for k in _keys(rand, 500):
        ranked = selector.rank(k, 1, 100)
        assert sorted(ranked) == list(range(7))
        assert ranked[0] == selector.pick(k, 1)


def test_bool_and_uint8_masks_agree(impl: type, rand) -> None:
    """A bool mask and the same uint8 mask give the same picks."""
    selector = impl(list(range(10)), np.ones((1, 10)))
    mask = rand.np.random(10) < 0.5
    mask[0] = True
    for k in _keys(rand, 300):
        assert selector.pick(k, 0, mask) == selector.pick(k, 0, mask.astype(np.uint8))


def test_tiny_weights_count_as_zero(impl: type) -> None:
    """A weight below 1e-300 x the row maximum is treated as zero (keeps scores finite)."""
    selector = impl([1, 2], [[1.0, 1e-301]])
    assert {selector.pick(k, 0) for k in range(5000)} == {0}


def test_rank_prefix_takes_the_first_key_whose_home_is_within_bound(impl: type) -> None:
    """Idle fleet: the first key's ranking. Its home over c x share: the next key's."""
    selector = impl(list(range(1, 5)), np.ones((1, 4)))
    keys = [11, 22, 33]
    idle = np.zeros(4, dtype=np.int64)
    assert selector.rank_prefix(keys, 0, 3, idle, 1.25) == (selector.rank(11, 0, 3), 0)
    home0, home1 = selector.pick(11, 0), selector.pick(22, 0)
    loads = np.full(4, 100, dtype=np.int64)
    loads[home0] = 126  # share 126/426 = 0.296 > 1.25 x 0.25
    ranked, used = selector.rank_prefix(keys, 0, 3, loads, 1.25)
    if home1 != home0:
        assert (ranked, used) == (selector.rank(22, 0, 3), 1)
    loads[home0] = 125  # 125/425 = 0.294 <= 0.3125: within bound again
    assert selector.rank_prefix(keys, 0, 3, loads, 1.25)[1] == 0


def test_rank_prefix_falls_back_to_the_engines_within_bound(impl: type) -> None:
    """Every key's home over bound: the last key's ranking over the within-bound engines."""
    selector = impl(list(range(1, 9)), np.ones((1, 8)))
    keys = [5, 6]
    loads = np.zeros(8, dtype=np.int64)
    for key in keys:
        loads[selector.pick(key, 0)] = 1000
    ranked, used = selector.rank_prefix(keys, 0, 8, loads, 1.5)
    assert used == len(keys)
    assert ranked and all(loads[i] == 0 for i in ranked)
    assert ranked == selector.rank(6, 0, 8, (loads == 0).astype(np.uint8))


def test_least_loaded_skips_ineligible_engines_and_breaks_ties_by_rendezvous(
    impl: type,
) -> None:
    """The least-loaded eligible engine; equal loads go where the key's rendezvous order
    says, so idle engines share such requests instead of all taking index 0."""
    selector = impl([1, 2, 3, 4], [[1.0, 0.0, 1.0, 1.0]])
    loads = np.array([5, 0, 3, 3], dtype=np.int64)  # engine 1 has weight 0
    ties = np.array([0, 0, 1, 1], dtype=np.uint8)
    for key in range(50):
        assert selector.least_loaded(key, 0, loads) == selector.pick(key, 0, ties)
    assert {selector.least_loaded(key, 0, loads) for key in range(50)} == {2, 3}
    assert selector.least_loaded(7, 0, loads, np.array([1, 1, 0, 1], dtype=np.uint8)) == 3
    assert selector.least_loaded(7, 0, loads, np.zeros(4, dtype=np.uint8)) == -1
    with pytest.raises(ValueError, match="loads"):
        selector.least_loaded(7, 0, loads[:2])
    with pytest.raises(IndexError):
        selector.least_loaded(7, 1, loads)


def test_rank_prefix_weights_shares_and_handles_edges(impl: type) -> None:
    """The bound is per weight share; no eligible engine gives ([], -1); bad args raise."""
    selector = impl([1, 2], [[3.0, 1.0]])
    loads = np.array([70, 30], dtype=np.int64)  # engine 0 holds 70 % with 75 % of the weight
    key = next(k for k in range(1000) if selector.pick(k, 0) == 0)
    assert selector.rank_prefix([key], 0, 2, loads, 1.0)[1] == 0
    assert selector.rank_prefix([key], 0, 2, loads, 1.0, np.zeros(2, dtype=np.uint8)) == ([], -1)
    with pytest.raises(ValueError, match="empty"):
        selector.rank_prefix([], 0, 2, loads, 1.25)
    with pytest.raises(ValueError, match="balance_factor"):
        selector.rank_prefix([key], 0, 2, loads, 0.9)
    with pytest.raises(ValueError, match="loads"):
        selector.rank_prefix([key], 0, 2, loads[:1], 1.25)
    with pytest.raises(OverflowError):
        selector.rank_prefix([2**64], 0, 2, loads, 1.25)


# -- compiled / pure parity --------------------------------------------------------------


# Defined only when the extension is built, so the pure-Python run has nothing to skip.
if "cy" in IMPLS:

    def test_compiled_matches_spec_on_random_tables(rand) -> None:
        """pick, rank and pick_bounded agree exactly on random tables, masks, loads and keys."""
        for trial in range(40):
            n = int(rand.np.integers(1, 60))
            n_classes = int(rand.np.integers(1, 4))
            ids = [int(x) for x in rand.np.integers(0, 2**64, size=n, dtype=np.uint64)]
            weights = rand.np.random((n_classes, n)) * (rand.np.random((n_classes, n)) < 0.8)
            if trial % 5 == 0:
                weights = np.round(weights * 3)  # many equal weights
            py, cy = _core.SelectorPy(ids, weights), _core.SelectorC(ids, weights)
            mask = (rand.np.random(n) < 0.85).astype(np.uint8)
            loads = rand.np.integers(0, 20, size=n).astype(np.int64)
            for key in _keys(rand, 150):
                row = int(rand.np.integers(0, n_classes))
                k = int(rand.np.integers(1, 9))
                assert py.pick(key, row) == cy.pick(key, row)
                assert py.pick(key, row, mask) == cy.pick(key, row, mask)
                assert py.rank(key, row, k) == cy.rank(key, row, k)
                assert py.rank(key, row, k, mask) == cy.rank(key, row, k, mask)
                assert py.pick_bounded(key, row, loads, 1.25, mask) == cy.pick_bounded(
                    key, row, loads, 1.25, mask
                )
                assert py.least_loaded(key, row, loads, mask) == cy.least_loaded(
                    key, row, loads, mask
                )
                chain = [key, *_keys(rand, int(rand.np.integers(0, 20)))]
                for factor in (1.0, 1.25, 3.0):
                    assert py.rank_prefix(chain, row, k, loads, factor, mask) == cy.rank_prefix(
                        chain, row, k, loads, factor, mask
                    )

    def test_compiled_matches_spec_on_idle_fleets_and_many_ties(rand) -> None:
        """Equal loads (an idle fleet: every engine over pick_bounded's bound, all tied at
        the least load) and a few load levels (ties above and below the count the
        compiled scan keeps)."""
        for n, levels in [(1, 1), (7, 1), (50, 1), (50, 2), (300, 3), (300, 40)]:
            ids = [engine_id(f"tie{i}") for i in range(n)]
            weights = rand.np.random((1, n)) + 0.05
            py, cy = _core.SelectorPy(ids, weights), _core.SelectorC(ids, weights)
            mask = (rand.np.random(n) < 0.9).astype(np.uint8)
            # A strided column, as the stats block's in-flight counters are.
            loads = rand.np.integers(0, levels, size=(n, 3)).astype(np.int64)[:, 1]
            for key in _keys(rand, 60):
                assert py.pick_bounded(key, 0, loads, 2.0) == cy.pick_bounded(key, 0, loads, 2.0)
                assert py.rank_prefix([key, 7], 0, 3, loads, 1.0, mask) == cy.rank_prefix(
                    [key, 7], 0, 3, loads, 1.0, mask
                )
                assert py.pick_bounded(key, 0, loads, 1.0, mask) == cy.pick_bounded(
                    key, 0, loads, 1.0, mask
                )
                assert py.least_loaded(key, 0, loads, mask) == cy.least_loaded(key, 0, loads, mask)
                assert py.least_loaded(key, 0, loads) == cy.least_loaded(key, 0, loads)


# -- statistical properties --------------------------------------------------------------


def test_share_of_keys_is_proportional_to_weight(impl: type, rand) -> None:
    """200k keys: every engine's share is within 5 binomial sigmas of its weight share.

    Each engine's count is Binomial(n, p_i); |count - n p_i| > 5 sqrt(n p_i (1 - p_i))
    has probability 5.7e-7 per engine, so 10 engines fail together with < 6e-6.
    """
    weights = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], dtype=float)
    ids = [engine_id(f"e{i}") for i in range(10)]
    selector = impl(ids, weights)
    n_keys = 200_000
    counts = np.bincount([selector.pick(k, 0) for k in _keys(rand, n_keys)], minlength=10)
    p = weights[0] / weights.sum()
    sigma = np.sqrt(n_keys * p * (1 - p))
    assert np.all(np.abs(counts - n_keys * p) < 5 * sigma), (counts, n_keys * p)


def test_removing_an_engine_moves_only_its_keys_to_their_runner_up(impl: type, rand) -> None:
    """Masking or zeroing engine j moves exactly j's keys, each to its rank-2 engine."""
    n = 12
    ids = [engine_id(f"e{i}") for i in range(n)]
    weights = rand.np.random((1, n)) + 0.1
    selector = impl(ids, weights)
    removed = 5
    mask = np.ones(n, dtype=np.uint8)
    mask[removed] = 0
    zeroed = weights.copy()
    zeroed[0, removed] = 0.0
    without = impl(ids, zeroed)
    moved = 0
    for k in _keys(rand, 20_000):
        before = selector.rank(k, 0, 2)
        after_mask = selector.pick(k, 0, mask)
        after_zero = without.pick(k, 0)
        expected = before[1] if before[0] == removed else before[0]
        assert after_mask == expected and after_zero == expected
        moved += before[0] == removed
    assert moved > 0


def test_small_weight_change_moves_about_twice_the_total_variation(impl: type, rand) -> None:
    """A 1 % transfer A->B and dense +-5 % noise move at most 2.2 x TV of the keys (+ noise).

    HRW is within about 2x of the TV lower bound (docs/algorithms.md §2.2); the slack is
    5 binomial sigmas of the measured fraction.
    """
    n = 40
    ids = [engine_id(f"e{i}") for i in range(n)]
    base = rand.np.random(n) + 0.5
    base /= base.sum()
    transfer = base.copy()
    transfer[0] -= 0.01
    transfer[1] += 0.01
    noisy = base * (1 + rand.np.uniform(-0.05, 0.05, n))
    noisy /= noisy.sum()
    keys = _keys(rand, 50_000)
    before = impl(ids, base[None, :])
    picks_before = np.array([before.pick(k, 0) for k in keys])
    for changed in (transfer, noisy):
        after = impl(ids, changed[None, :])
        moved = np.mean(picks_before != np.array([after.pick(k, 0) for k in keys]))
        tv = 0.5 * np.abs(changed - base).sum()
        slack = 5 * math.sqrt(2.2 * tv * (1 - 2.2 * tv) / len(keys))
        assert moved <= 2.2 * tv + slack, (moved, tv)
        assert moved >= tv - slack  # and no stateless scheme beats the TV bound


def test_engine_order_does_not_change_picks(impl: type, rand) -> None:
    """Permuting the engines (ids with their weight columns) picks the same engine ids."""
    n = 25
    ids = np.array([engine_id(f"e{i}") for i in range(n)], dtype=np.uint64)
    weights = rand.np.random((2, n))
    perm = rand.np.permutation(n)
    a, b = impl(ids, weights), impl(ids[perm], weights[:, perm])
    for k in _keys(rand, 2000):
        assert ids[a.pick(k, 1)] == ids[perm][b.pick(k, 1)]
        assert list(ids[a.rank(k, 1, 3)]) == list(ids[perm][b.rank(k, 1, 3)])


def test_scaling_a_row_does_not_change_picks(impl: type, rand) -> None:
    """Weights are relative: multiplying a row by a constant changes nothing."""
    ids = list(range(30))
    weights = rand.np.random((1, 30))
    a, b = impl(ids, weights), impl(ids, weights * 1000.0)
    assert all(a.pick(k, 0) == b.pick(k, 0) for k in _keys(rand, 3000))


def test_same_picks_in_a_separate_process(impl: type) -> None:
    """Another interpreter (different hash salt) computes the same picks for the same keys."""
    impl_name = "SelectorPy" if impl is _core.SelectorPy else "SelectorC"
    code = (
        "from fastroute import _core\n"
        "from fastroute.hashing import engine_id, key_hash\n"
        f"s = _core.{impl_name}([engine_id(f'e{{i}}') for i in range(50)],"
        " [[1 + (i % 7) for i in range(50)]])\n"
        "print(','.join(str(s.pick(key_hash(f'user-{i}'), 0)) for i in range(500)))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    local = impl([engine_id(f"e{i}") for i in range(50)], [[1 + (i % 7) for i in range(50)]])
    assert out == ",".join(str(local.pick(key_hash(f"user-{i}"), 0)) for i in range(500))


# -- bounded load --------------------------------------------------------------------------


def test_bounded_load_keeps_the_pick_when_under_the_bound(impl: type, rand) -> None:
    """With balanced loads the bounded pick equals the plain pick (affinity kept)."""
    selector = impl(list(range(8)), np.ones((1, 8)))
    loads = np.full(8, 10, dtype=np.int64)
    for k in _keys(rand, 1000):
        assert selector.pick_bounded(k, 0, loads, 2.0) == selector.pick(k, 0)


def test_bounded_load_walks_past_an_overloaded_engine(impl: type, rand) -> None:
    """Keys of a hot engine spill to their next ranked engine under the bound."""
    selector = impl(list(range(8)), np.ones((1, 8)))
    for k in _keys(rand, 1000):
        ranked = selector.rank(k, 0, 8)
        loads = np.zeros(8, dtype=np.int64)
        loads[ranked[0]] = 100  # bound = 2 * 101 / 8 = 25.25
        assert selector.pick_bounded(k, 0, loads, 2.0) == ranked[1]
        loads[ranked[1]] = 100  # both over: 2 * 201 / 8 = 50.25
        assert selector.pick_bounded(k, 0, loads, 2.0) == ranked[2]


def test_bounded_load_caps_the_maximum_load(impl: type, rand) -> None:
    """Assigning 4000 requests of one hot key set keeps every engine <= c x average + 1."""
    weights = np.array([[1.0, 1.0, 2.0, 4.0]])
    selector = impl([11, 22, 33, 44], weights)
    loads = np.zeros(4, dtype=np.int64)
    hot_keys = _keys(rand, 20)  # few keys: plain HRW would pile them on few engines
    for i in range(4000):
        e = selector.pick_bounded(hot_keys[i % 20], 0, loads, 1.5)
        loads[e] += 1
    share = weights[0] / weights.sum()
    assert np.all(loads <= 1.5 * (loads.sum()) * share + 1), loads
