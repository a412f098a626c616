"""The proportional-controller baseline (controller.pcontroller) against reference §8.

The simulated fleet: 8 heterogeneous M/M/1-like engines (service rates ``MU``) at 75 % total load,
latency ``1/(μ_e (1 − ρ_e))`` with ``ρ_e`` capped at 0.99, 3 % multiplicative measurement noise
(seeded), 300 periods, metrics over the second half (docs/algorithms.md §8.2).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from controller.pcontroller import (
    ProportionalController,
    critical_gain,
    loop_gain,
    spectral_radius,
    weight_amplitude,
)
from controller.weights import churn

MU = np.array([0.6, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4, 1.6])
NAMES = [f"engine-{i}" for i in range(len(MU))]


def simulate(
    gain: float, delay: int, alpha: float, *, periods: int = 300, seed: int = 1
) -> tuple[float, float]:
    """Mean churn per period and the weight amplitude over the second half."""
    rng = np.random.default_rng(seed)
    lam = 0.75 * MU.sum()
    pc = ProportionalController(
        gain, alpha, delay, 1e-3, initial_weights=dict(zip(NAMES, MU / MU.sum(), strict=True))
    )
    w = pc.weights.copy()
    history = [w]
    for t in range(periods):
        rho = np.minimum(lam * w / MU, 0.99)
        latency = (1.0 + 0.03 * rng.standard_normal(len(MU))) / (MU * (1.0 - rho))
        out = pc.step(dict(zip(NAMES, latency, strict=True)), float(t))
        w = np.array([out[n] for n in NAMES])
        history.append(w)
    h = np.array(history)[periods // 2 :]
    tv = [churn(h[i - 1][None], h[i][None], [1.0]) for i in range(1, len(h))]
    return float(np.mean(tv)), weight_amplitude(h)


def test_small_gain_without_delay_settles() -> None:
    """K = 0.2, D = 0: churn per period < 1 % and the weights barely move (table: 0.28 %)."""
    tv, amplitude = simulate(0.2, 0, 1.0)
    assert tv < 0.01
    assert amplitude < 0.02


def test_delay_and_smoothing_make_it_oscillate() -> None:
    """K = 0.5, D = 2, a = 0.3 (G ≈ 1.5 ≫ 0.537): churn > 5 % per period, large swings."""
    tv, amplitude = simulate(0.5, 2, 0.3)
    assert tv > 0.05
    assert amplitude > 0.2
    # K = 0.2 is already past the smoothed critical gain at 75 % load (reference §8.2 note)
    assert loop_gain(0.2, 0.75) > critical_gain(2, 0.3)
    assert simulate(0.2, 2, 0.3)[0] > 0.02


def test_simulation_is_deterministic() -> None:
    """Same seed, same result (the controller is pure)."""
    assert simulate(0.5, 2, 0.3, periods=60) == simulate(0.5, 2, 0.3, periods=60)


@pytest.mark.parametrize(
    ("delay", "expected"), [(0, 2.0), (1, 1.0), (2, 0.618), (3, 0.445), (5, 0.285), (10, 0.149)]
)
def test_critical_gain_formula_matches_the_table(delay: int, expected: float) -> None:
    """2 sin(π/(2(2D+1))) against the a = 1 column of reference §8.1."""
    assert critical_gain(delay) == pytest.approx(expected, abs=1e-3)
    assert spectral_radius(0.99 * critical_gain(delay), delay) < 1.0
    assert spectral_radius(1.01 * critical_gain(delay), delay) > 1.0


@pytest.mark.parametrize(
    ("delay", "alpha", "expected"),
    [(0, 0.5, 6.0), (0, 0.3, 11.3), (1, 0.1, 1.0), (2, 0.3, 0.537), (5, 0.1, 0.215)],
)
def test_critical_gain_with_smoothing_matches_the_table(
    delay: int, alpha: float, expected: float
) -> None:
    """Bisection on the spectral radius reproduces the measured columns."""
    assert critical_gain(delay, alpha) == pytest.approx(expected, abs=1.5e-3, rel=5e-3)


def test_loop_gain() -> None:
    """G = K ρ/(1−ρ): ×3 at 75 %, ×9 at 90 %."""
    assert loop_gain(0.2, 0.75) == pytest.approx(0.6)
    assert loop_gain(1.0, 0.9) == pytest.approx(9.0)
    with pytest.raises(ValueError):
        loop_gain(1.0, 1.0)


def test_step_is_the_reference_update() -> None:
    """One step by hand: w ← w (1 − K (ŝ − s̄)/s̄), clamp, renormalise."""
    pc = ProportionalController(0.5, 1.0, 0, 0.0, engines=["a", "b"])
    w = pc.step({"a": 3.0, "b": 1.0}, 0.0)  # s̄ = 2: a × 0.75, b × 1.25
    assert w["a"] == pytest.approx(0.375 / 1.0) and w["b"] == pytest.approx(0.625)
    assert math.fsum(w.values()) == pytest.approx(1.0)
    # a huge deviation is clamped to the floor, then renormalised
    pc = ProportionalController(2.0, 1.0, 0, 0.01, engines=["a", "b"])
    w = pc.step({"a": 10.0, "b": 1.0}, 0.0)  # a × (1 − 2·9/11) < 0 → 0.01; b × (1 + 2·9/11)
    b = 0.5 * (1.0 + 18.0 / 11.0)
    assert w["a"] == pytest.approx(0.01 / (0.01 + b)) and w["b"] == pytest.approx(b / (0.01 + b))


def test_delay_line_and_ewma() -> None:
    """Weights hold while the delay line fills; the EWMA starts at the first delayed sample."""
    pc = ProportionalController(0.5, 0.5, 2, 0.0, engines=["a", "b"])
    equal = {"a": 0.5, "b": 0.5}
    assert pc.step({"a": 3.0, "b": 1.0}, 0.0) == equal
    assert pc.step({"a": 1.0, "b": 1.0}, 1.0) == equal
    w = pc.step({"a": 1.0, "b": 1.0}, 2.0)  # uses period 0: ŝ = (3, 1)
    assert w["a"] == pytest.approx(0.375)
    np.testing.assert_allclose(pc.estimate_s, [3.0, 1.0])
    pc.step({"a": 1.0, "b": 1.0}, 3.0)  # uses period 1: ŝ = (2, 1)
    np.testing.assert_allclose(pc.estimate_s, [2.0, 1.0])


def test_validation() -> None:
    """Bad parameters and inputs raise ValueError."""
    for args in [(0.0,), (0.1, 0.0), (0.1, 1.0, -1), (0.1, 1.0, 0, 1.0)]:
        with pytest.raises(ValueError):
            ProportionalController(*args)
    pc = ProportionalController(0.1)
    pc.step({"a": 1.0, "b": 2.0}, 5.0)
    assert pc.engines == ("a", "b")
    with pytest.raises(ValueError, match="exactly"):
        pc.step({"a": 1.0}, 6.0)
    with pytest.raises(ValueError, match="backwards"):
        pc.step({"a": 1.0, "b": 1.0}, 4.0)
    with pytest.raises(ValueError, match="> 0"):
        pc.step({"a": 0.0, "b": 1.0}, 7.0)
    assert weight_amplitude([[0.5, 0.5]]) == 0.0
    assert weight_amplitude([[0.5, 0.5], [0.2, 0.8]]) == pytest.approx(0.3)
