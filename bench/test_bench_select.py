"""Selector speed (ns per call, Python call overhead included) and disruption quality."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.testing.tables import make_table

ENGINE_COUNTS = [10, 100, 1000]


CALLS_PER_ROUND = 1000


def _per_call(benchmark, run) -> None:
    """Time ``run`` (CALLS_PER_ROUND calls in a plain for loop); record ns per call."""
    benchmark(run)
    if benchmark.stats is not None:  # None under --benchmark-disable
        stats = benchmark.stats.stats
        benchmark.extra_info["median_ns_per_call"] = round(1e9 * stats.median / CALLS_PER_ROUND, 1)
        benchmark.extra_info["min_ns_per_call"] = round(1e9 * stats.min / CALLS_PER_ROUND, 1)


@pytest.mark.benchmark(group="pick")
@pytest.mark.parametrize("n_engines", ENGINE_COUNTS)
def test_pick(benchmark, selector_impl, n_engines, keys) -> None:
    """pick() over a class row of n engines; a round is 1000 calls (divide by 1000)."""
    selector = selector_impl(*make_table(n_engines))
    pick, batch = selector.pick, keys[:CALLS_PER_ROUND]

    def run() -> None:
        for key in batch:
            pick(key, 1)

    _per_call(benchmark, run)
    assert 0 <= pick(keys[0], 1) < n_engines


@pytest.mark.benchmark(group="rank3")
@pytest.mark.parametrize("n_engines", ENGINE_COUNTS)
def test_rank3(benchmark, selector_impl, n_engines, keys) -> None:
    """rank(k=3) over a class row of n engines; a round is 1000 calls."""
    selector = selector_impl(*make_table(n_engines))
    rank, batch = selector.rank, keys[:CALLS_PER_ROUND]

    def run() -> None:
        for key in batch:
            rank(key, 1, 3)

    _per_call(benchmark, run)
    assert len(rank(keys[0], 1, 3)) == 3


@pytest.mark.benchmark(group="pick-bounded")
@pytest.mark.parametrize("n_engines", [100])
def test_pick_bounded(benchmark, selector_impl, n_engines, keys) -> None:
    """pick_bounded() with balanced loads (the common, fast path); a round is 1000 calls."""
    selector = selector_impl(*make_table(n_engines))
    loads = np.full(n_engines, 4, dtype=np.int64)
    pick_bounded, batch = selector.pick_bounded, keys[:CALLS_PER_ROUND]

    def run() -> None:
        for key in batch:
            pick_bounded(key, 1, loads, 2.0)

    _per_call(benchmark, run)


@pytest.mark.benchmark(group="disruption")
def test_disruption_vs_total_variation(benchmark, keys) -> None:
    """Fraction of 50k keys moved by weight changes, against the TV lower bound.

    Reported in ``extra_info`` (docs/algorithms.md §2.2; figures in docs/benchmarks.md).
    """
    from fastroute._core import Selector

    n = 100
    ids, weights = make_table(n, n_classes=1)
    base = weights[0] / weights[0].sum()
    rng = np.random.default_rng(3)
    sample = [int(k) for k in rng.integers(0, 2**64, size=50_000, dtype=np.uint64)]
    before = Selector(ids, base[None, :])
    picks = np.array([before.pick(k, 0) for k in sample])

    transfer = base.copy()
    transfer[0] -= 0.01
    transfer[1] += 0.01
    removed = base.copy()
    removed[5] = 0.0
    removed /= removed.sum()
    derated = base.copy()
    derated[7] *= 0.5
    derated /= derated.sum()
    cases = {"transfer_1pct": transfer, "remove_one": removed, "derate_one_half": derated}

    def measure() -> dict[str, float]:
        out = {}
        for name, changed in cases.items():
            after = Selector(ids, changed[None, :])
            moved = float(np.mean(picks != np.array([after.pick(k, 0) for k in sample])))
            out[f"{name}_moved_pct"] = round(100 * moved, 3)
            out[f"{name}_tv_pct"] = round(100 * 0.5 * float(np.abs(changed - base).sum()), 3)
        return out

    result = benchmark.pedantic(measure, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    assert result["remove_one_moved_pct"] > 0
