"""Hierarchical rendezvous (``fastroute/_core/selector_tree.py``): shares, failover order,
disruption, load chunks, and parity of the compiled selector with the spec."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute import _core
from fastroute._core.selector_tree import LEAF_CAP, LOAD_CHUNK, WALK_CAP, build_tree

IMPLS = [_core.SelectorPy] + ([_core.SelectorC] if _core.SelectorC is not None else [])
FAST = _core.SelectorC or _core.SelectorPy  # for the statistical tests


def _fleet(rng: np.random.Generator, n: int, rows: int = 1) -> tuple[list[int], np.ndarray]:
    ids = [int(x) for x in rng.integers(1, 2**63, size=n)]
    return ids, rng.choice([0.5, 1.0, 2.0, 4.0], size=(rows, n))


def _keys(rng: np.random.Generator, count: int) -> list[int]:
    return [int(x) for x in rng.integers(0, 2**64, size=count, dtype=np.uint64)]


def test_the_trie_covers_every_eligible_engine_once_with_subtree_weights() -> None:
    rng = np.random.default_rng(1)
    ids, weights = _fleet(rng, 3000)
    sel = _core.SelectorPy(ids, weights)
    eligible = list(range(0, 3000, 3))
    tree = build_tree(sel._seeds, sel._w[0], eligible)
    assert sorted(tree.order.tolist()) == eligible
    buckets = np.flatnonzero(tree.node_bucket)
    members = sorted(
        int(tree.order[p])
        for b in buckets
        for p in range(tree.node_first[b], tree.node_first[b] + tree.node_n[b])
    )
    assert members == eligible
    assert tree.node_n[buckets].max() <= LEAF_CAP
    assert tree.total_w == pytest.approx(sum(sel._w[0][i] for i in eligible), rel=1e-12)
    for q in np.flatnonzero(tree.node_bucket == 0):
        kids = range(tree.node_first[q], tree.node_first[q] + tree.node_n[q])
        assert tree.node_count[q] == sum(tree.node_count[c] for c in kids)
    # Only the set matters, not table order: the same engines listed backwards.
    again = build_tree(sel._seeds, sel._w[0], eligible[::-1])
    assert np.array_equal(again.order, tree.order) and np.array_equal(again.node_w, tree.node_w)


@pytest.mark.parametrize("n", [12, 300, 3000])
def test_long_run_shares_follow_the_weights(n: int) -> None:
    """Chi-square of the homes of many keys against the weight shares: the tree keeps the
    exponential race's exact shares at every level."""
    rng = np.random.default_rng(n)
    ids, weights = _fleet(rng, n)
    sel = FAST(ids, weights)
    n_keys = 200 * n
    counts = np.zeros(n)
    for key in _keys(rng, n_keys):
        counts[sel.tree_rank(key, 0, 1)[0]] += 1
    expected = n_keys * weights[0] / weights[0].sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = n - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # about 5 sigma
    assert np.abs(counts / expected - 1).max() < 0.5


@pytest.mark.parametrize("impl", IMPLS)
def test_the_failover_order_is_where_the_key_goes_without_the_engines_before(impl) -> None:
    rng = np.random.default_rng(2)
    n = 400
    ids, weights = _fleet(rng, n)
    sel = impl(ids, weights)
    full = np.ones(n, dtype=np.uint8)
    for key in _keys(rng, 60 if impl is _core.SelectorPy else 400):
        ranked = sel.tree_rank(key, 0, 4, full)
        assert len(set(ranked)) == 4
        mask = full.copy()
        mask[ranked[0]] = 0
        assert sel.tree_rank(key, 0, 3, mask) == ranked[1:]


def test_removing_one_engine_moves_its_keys_and_a_few_per_level() -> None:
    """Flat rendezvous moves 1/n of the keys; the tree moves the removed engine's keys
    (each to its runner-up) plus about 1/n per internal level."""
    rng = np.random.default_rng(3)
    for n, bound in ((100, 3.0), (1000, 4.0)):
        ids = [int(x) for x in rng.integers(1, 2**63, size=n)]
        sel = FAST(ids, np.ones((1, n)))
        keys = _keys(rng, 50 * n)
        full = np.ones(n, dtype=np.uint8)
        before = [sel.tree_rank(key, 0, 2, full) for key in keys]
        moved = 0.0
        for gone in rng.choice(n, size=4, replace=False):
            mask = full.copy()
            mask[gone] = 0
            after = [sel.tree_rank(key, 0, 1, mask)[0] for key in keys]
            for b, a in zip(before, after, strict=True):
                if b[0] == gone:
                    assert a == b[1]  # the removed engine's keys go to their runner-up
            moved += sum(b[0] != a for b, a in zip(before, after, strict=True)) / len(keys) / 4
        assert 1.0 <= moved * n < bound, moved * n


@pytest.mark.parametrize("impl", IMPLS)
def test_rank_prefix_on_the_tree_bounds_the_home_and_walks_for_the_fallback(impl) -> None:
    n = 40
    rng = np.random.default_rng(4)
    ids, _ = _fleet(rng, n)
    sel = impl(ids, np.ones((1, n)))
    keys = [11, 22]
    idle = np.zeros(n, dtype=np.int64)
    assert sel.tree_rank_prefix(keys, 0, 3, idle, 2.0) == (sel.tree_rank(11, 0, 3), 0)
    loads = np.full(n, 10, dtype=np.int64)
    loads[sel.tree_rank(11, 0, 1)[0]] = 10**6
    assert sel.tree_rank_prefix(keys, 0, 3, loads, 2.0) == (sel.tree_rank(22, 0, 3), 1)
    loads[sel.tree_rank(22, 0, 1)[0]] = 10**6
    ranked, used = sel.tree_rank_prefix(keys, 0, 3, loads, 2.0)
    assert used == 2 and all(loads[i] == 10 for i in ranked)
    order = [i for i in sel.tree_rank(22, 0, n) if loads[i] == 10]
    assert ranked == order[:3]
    assert sel.tree_rank_prefix(keys, 0, 3, loads, 2.0, np.zeros(n, dtype=np.uint8)) == ([], -1)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_home_slack_lets_only_the_first_home_exceed_the_bound(impl) -> None:
    """``home_slack`` tokens come off the first key's home's load before its bound check
    (what staying saves); later keys' homes and the fallback walk use the plain bound."""
    n = 8
    sel = impl(list(range(1, n + 1)), np.ones((1, n)))
    home, second = sel.tree_rank(11, 0, 1)[0], sel.tree_rank(22, 0, 1)[0]
    assert home != second
    loads = np.full(n, 100, dtype=np.int64)
    loads[home] = 1000  # bound at c = 2: L_e <= 2 * total / 8 = 2 * 1700 / 8 = 425
    assert sel.tree_rank_prefix([11, 22], 0, 1, loads, 2.0)[1] == 1
    assert sel.tree_rank_prefix([11, 22], 0, 1, loads, 2.0, None, 500)[1] == 1  # 500 > 425
    assert sel.tree_rank_prefix([11, 22], 0, 1, loads, 2.0, None, 600) == ([home], 0)
    loads[second] = 1000  # the second home gets no slack: the walk decides
    ranked, used = sel.tree_rank_prefix([22, 11], 0, 1, loads, 2.0, None, 0)
    assert used == 2 and loads[ranked[0]] == 100
    with pytest.raises(ValueError, match="home_slack"):
        sel.tree_rank_prefix([11], 0, 1, loads, 2.0, None, -1)


def test_the_fallback_walks_at_most_walk_cap_positions() -> None:
    n = 2 * WALK_CAP
    sel = FAST(list(range(1, n + 1)), np.ones((1, n)))
    order = sel.tree_rank(5, 0, n)
    loads = np.zeros(n, dtype=np.int64)
    loads[order[:WALK_CAP]] = 10**6  # within bound only past the walk: every home is not
    ranked, used = sel.tree_rank_prefix([5], 0, 2, loads, 1.0)
    assert used == 1 and ranked == order[:2]  # none found: the ranking over E


@pytest.mark.parametrize("impl", IMPLS)
def test_the_load_total_is_exact_within_one_round_of_chunks(impl) -> None:
    """Above LOAD_CHUNK engines the total is re-read one chunk per call: a home that the
    exact total puts within bound is taken once every chunk was re-read."""
    n = 3 * LOAD_CHUNK
    sel = impl(list(range(1, n + 1)), np.ones((1, n)))
    home = sel.tree_rank(7, 0, 1)[0]
    loads = np.zeros(n, dtype=np.int64)
    assert sel.tree_rank_prefix([7], 0, 1, loads, 2.0)[1] == 0  # first call: full read
    loads[:] = 100
    loads[home] = 150  # within bound (150 n <= 2 * 100 n) by the exact total only
    used = [sel.tree_rank_prefix([7], 0, 1, loads, 2.0)[1] for _ in range(3)]
    assert used[-1] == 0 and used[0] == 1  # stale at first (total 0 + one chunk), then exact
    # The least-loaded engine: the least live load among the chunks' least engines as
    # of their last read, so an engine whose load fell is seen once its chunk is re-read.
    loads[home] = 0
    for _ in range(3):
        sel.tree_rank_prefix([7], 0, 1, loads, 2.0)
    assert sel.tree_least_loaded(7, 0, loads) == home
    loads[home] = 200  # a least engine that filled since: its live load counts
    assert loads[sel.tree_least_loaded(7, 0, loads)] == 100


@pytest.mark.parametrize("impl", IMPLS)
def test_within_bound_is_the_first_homes_test_for_any_engine(impl) -> None:
    """``tree_within_bound``: ``(L_e - slack) · W <= c · total · w_e``, the total as of the
    tree's last ranking (read whole when there was none); ``eligible_index``: the index of an
    engine id that is in the table, weighted in the row and not masked out, else -1."""
    n = 8
    weights = np.ones((2, n))
    weights[1, 3] = 0.0
    sel = impl(list(range(1, n + 1)), weights)
    loads = np.full(n, 100, dtype=np.int64)
    loads[2] = 425  # total 1125: 425 * 8 = 3400 > 2 * 1125 = 2250
    assert not sel.tree_within_bound(2, 0, loads, 2.0)
    assert sel.tree_within_bound(2, 0, loads, 2.0, None, 144)  # 281 * 8 = 2248 <= 2250
    assert not sel.tree_within_bound(2, 0, loads, 2.0, None, 143)
    assert sel.tree_within_bound(2, 0, loads, 4.0)
    assert sel.eligible_index(3, 0) == 2 and sel.eligible_index(99, 0) == -1
    assert sel.eligible_index(4, 1) == -1  # weight 0 in row 1
    mask = np.ones(n, dtype=np.uint8)
    mask[2] = 0
    assert sel.eligible_index(3, 0, mask) == -1 and sel.eligible_index(2, 0, mask) == 1
    with pytest.raises(IndexError):
        sel.eligible_index(3, 2)


def test_a_mask_changed_in_place_is_seen() -> None:
    n = 50
    sel = FAST(list(range(1, n + 1)), np.ones((1, n)))
    mask = np.ones(n, dtype=np.uint8)
    home = sel.tree_rank(9, 0, 1, mask)[0]
    mask[home] = 0
    assert home not in sel.tree_rank(9, 0, n, mask)
    assert sel.tree_size(0, mask) == n - 1 and sel.tree_size(0) == n


@pytest.mark.parity
@pytest.mark.skipif(_core.SelectorC is None, reason="extension not built")
def test_compiled_tree_matches_the_spec() -> None:
    """tree_rank, tree_rank_prefix, tree_least_loaded, tree_within_bound and eligible_index
    agree value for value on random fleets (one and several load chunks), rows, masks, loads
    and call sequences."""
    rng = np.random.default_rng(6)
    for n in (1, 2, 17, 40, 300, 1100):
        ids, weights = _fleet(rng, n, rows=2)
        weights *= rng.random((2, n)) < 0.9
        weights[:, 0] = 1.0
        py, cy = _core.SelectorPy(ids, weights), _core.SelectorC(ids, weights)
        masks = [None] + [(rng.random(n) < 0.9).astype(np.uint8) for _ in range(3)]
        for step in range(40):
            mask, row = masks[step % len(masks)], step % 2
            key = _keys(rng, 1)[0]
            k = int(rng.integers(1, 12))
            assert py.tree_rank(key, row, k, mask) == cy.tree_rank(key, row, k, mask)
            levels = 1 if step % 5 == 0 else 40  # many ties at the least load, or few
            loads = rng.integers(0, levels, size=n).astype(np.int64) * 100
            loads[int(rng.integers(0, n))] += 10**6
            keys = _keys(rng, 3)
            c = float(rng.choice([1.0, 1.25, 2.0]))
            slack = int(rng.choice([0, 100, 10**6]))
            assert py.tree_rank_prefix(keys, row, k, loads, c, mask, slack) == (
                cy.tree_rank_prefix(keys, row, k, loads, c, mask, slack)
            ), (n, step, slack)
            assert py.tree_least_loaded(key, row, loads, mask) == cy.tree_least_loaded(
                key, row, loads, mask
            )
            e = int(rng.integers(0, n))
            assert py.tree_within_bound(e, row, loads, c, mask, slack) == (
                cy.tree_within_bound(e, row, loads, c, mask, slack)
            )
            assert py.eligible_index(ids[e], row, mask) == cy.eligible_index(ids[e], row, mask)


@pytest.mark.parametrize("impl", IMPLS)
def test_many_ties_at_the_least_load_are_spread_by_key(impl) -> None:
    """An idle half of the fleet: the chunks keep SCAN_TIES ties each, and the key's own
    ranking spreads the least-loaded choices over all the idle engines, not the kept few."""
    n = 2 * LOAD_CHUNK
    sel = impl(list(range(1, n + 1)), np.ones((1, n)))
    loads = np.full(n, 500, dtype=np.int64)
    loads[::2] = 0
    chosen = {sel.tree_least_loaded(key, 0, loads) for key in range(300)}
    assert all(loads[i] == 0 for i in chosen)
    assert len(chosen) > 100  # 2 chunks x SCAN_TIES = 16 without the walk
