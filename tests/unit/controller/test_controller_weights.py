"""Weight rows, shed fractions, validation before publishing, and the churn metric."""

from __future__ import annotations

import numpy as np
import pytest

from controller.groups import group_engines
from controller.latency import LatencyProfile
from controller.weights import (
    churn,
    class_weights,
    engine_weights,
    region_engine_weights,
    shed_at_demand,
    table_anchor,
    validate_weights,
)
from fastroute.errors import TableValueError


def test_class_weights_normalise_served_traffic() -> None:
    """w = x / (D − shed), σ = shed / D; fully shed → zero row; zero demand → fallback row."""
    x = np.array([[3.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    weights, sigma = class_weights(
        x, [1.0, 5.0, 0.0], [5.0, 5.0, 0.0], fallback=np.array([[1.0, 1.0, 2.0]] * 3)
    )
    assert weights[0] == pytest.approx([0.75, 0.25, 0.0])
    assert weights[1].tolist() == [0.0, 0.0, 0.0]  # fully shed: no fallback
    assert weights[2] == pytest.approx([0.25, 0.25, 0.5])  # zero demand: fallback
    assert sigma == pytest.approx([0.2, 1.0, 0.0])
    validate_weights(weights, sigma)


def test_engine_weights_split_groups_by_effective_capacity() -> None:
    """Group rows become engine rows ∝ C·h inside each group and still sum to 1."""
    p = LatencyProfile.seed(0.1, 0.01)
    rtt = np.array([[0.01, 0.01, 0.05]])
    groups = group_engines([p, p, p], [10.0, 30.0, 5.0], np.ones((1, 3), bool), rtt)
    w = engine_weights(np.array([[0.8, 0.2]]), groups)
    assert w[0] == pytest.approx([0.2, 0.6, 0.2])
    validate_weights(w, np.zeros(1))


@pytest.mark.parametrize(
    ("weights", "sigma", "match"),
    [
        ([[0.5, np.nan]], [0.0], "finite"),
        ([[1.5, -0.5]], [0.0], ">= 0"),
        ([[0.5, 0.4]], [0.0], "sum to 1"),
        ([[0.5, 0.5]], [1.5], r"\[0, 1\]"),
        ([[1.0]], [0.0, 0.0], "expected"),
    ],
)
def test_validation_rejects_bad_tables(weights, sigma, match) -> None:
    """NaN, negative, mis-normalised rows and shed fractions outside [0, 1] are refused."""
    with pytest.raises(TableValueError, match=match):
        validate_weights(np.asarray(weights), np.asarray(sigma))


def test_churn_is_demand_weighted_total_variation(rand) -> None:
    """Identical tables → 0; a full swap → 1; one class of two half-moved → D-weighted ½·TV."""
    w = rand.np.dirichlet(np.ones(4), 3)
    demand = np.array([1.0, 2.0, 1.0])
    assert churn(w, w, demand) == 0.0
    a = np.array([[1.0, 0.0], [1.0, 0.0]])
    b = np.array([[0.0, 1.0], [0.0, 1.0]])
    assert churn(a, b, [1.0, 3.0]) == pytest.approx(1.0)
    c = np.array([[0.5, 0.5], [1.0, 0.0]])
    assert churn(a, c, [1.0, 3.0]) == pytest.approx(0.5 * 1.0 / 4.0)
    assert churn(a, b, [0.0, 0.0]) == 0.0


def test_table_anchor_is_the_old_table_applied_to_the_new_demand() -> None:
    """x · D'/D per class: unchanged demand reproduces x exactly (the κ fixed point); a class
    without previous demand anchors at 0; bad demands are rejected."""
    x = np.array([[3.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    d0 = np.array([4.0, 0.0, 5.0])  # class 2 shed 1 of 5
    assert np.array_equal(table_anchor(x, d0, d0), x)
    out = table_anchor(x, d0, np.array([8.0, 3.0, 10.0]))
    np.testing.assert_allclose(out, [[6.0, 2.0], [0.0, 0.0], [4.0, 4.0]])
    w_old = x[0] / x[0].sum()
    np.testing.assert_allclose(out[0] / out[0].sum(), w_old)
    with pytest.raises(ValueError, match="finite"):
        table_anchor(x, d0, np.array([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="shapes"):
        table_anchor(x, d0[:2], d0[:2])


def test_shed_at_demand_admits_the_routed_rate_out_of_the_live_demand() -> None:
    """A shed class admits Σx of the live demand; unshed classes get 0; the solved-for demand
    reproduces class_weights' shed / D."""
    x = np.array([[30.0, 30.0], [10.0, 0.0], [1e-14, 0.0]])  # row 2: no allocation
    shed = np.array([40.0, 0.0, 5.0])
    solved = np.array([100.0, 10.0, 5.0])
    _, sigma = class_weights(x, shed, solved)
    np.testing.assert_allclose(shed_at_demand(x, shed, solved), sigma)
    live = np.array([120.0, 14.0, 6.0])  # higher than planned for: class 1 was not shed
    np.testing.assert_allclose(shed_at_demand(x, shed, live), [0.5, 0.0, 1.0])
    assert shed_at_demand(x, shed, live)[2] == 1.0  # exactly: its row is published all zero
    np.testing.assert_allclose(shed_at_demand(x, shed, [50.0, 10.0, 0.0]), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        shed_at_demand(x, shed, [1.0, -1.0, 1.0])
    with pytest.raises(ValueError):
        shed_at_demand(x, shed[:2], live)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_engine_weights_match_split_then_normalise(seed: int) -> None:
    """The one-gather path gives the rows of splitting first and normalising engine rows after."""
    rng = np.random.default_rng(seed)
    shapes = [LatencyProfile.seed(0.1, 0.01), LatencyProfile.seed(0.05, 0.006)]
    n_e = 30
    region = rng.integers(0, 3, n_e)
    health = np.where(rng.random(n_e) < 0.3, 0.0, 1.0)
    groups = group_engines(
        [shapes[i % 2] for i in range(n_e)],
        rng.choice([8.0, 12.0], n_e),
        rng.random((5, 3))[:, region] < 0.8,
        rng.uniform(0.002, 0.1, (5, 3))[:, region],
        health=health,
    )
    wg = rng.random((5, groups.n_groups)) * (rng.random((5, groups.n_groups)) < 0.6)
    split = groups.split(wg)
    total = split.sum(axis=1, keepdims=True)
    expected = np.divide(split, total, out=np.zeros_like(split), where=total > 0)
    np.testing.assert_allclose(engine_weights(wg, groups), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="group rows"):
        engine_weights(wg[:, :-1], groups)


@pytest.mark.parametrize("seed", [7, 8])
def test_region_engine_weights_is_the_block_of_the_dense_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    shapes = [LatencyProfile.seed(0.1, 0.01), LatencyProfile.seed(0.05, 0.006)]
    n_e = 30
    region = rng.integers(0, 3, n_e)
    elig = rng.random((6, 3))[:, region] < 0.8
    groups = group_engines(
        [shapes[i % 2] for i in range(n_e)],
        rng.choice([8.0, 12.0], n_e),
        elig,
        rng.uniform(0.002, 0.1, (6, 3))[:, region],
        health=np.where(rng.random(n_e) < 0.3, 0.0, 1.0),
    )
    wg = rng.random((6, groups.n_groups)) * groups.eligible
    rows = np.array([1, 4, 5])
    cols = np.flatnonzero(elig[rows].any(axis=0))
    block = region_engine_weights(wg, groups, rows, cols)
    np.testing.assert_allclose(block, engine_weights(wg, groups)[np.ix_(rows, cols)], atol=1e-12)
    sums = block.sum(axis=1)
    assert np.all(np.isclose(sums, 1.0) | (sums == 0.0))
