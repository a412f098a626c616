"""Split-conformal p90: the rank rule, and coverage on held-out step times."""

from __future__ import annotations

import math

import pytest

from fastroute.hardware import get_profile
from fastroute.predict import ConformalBound, NominalStepTimes, StepTimeModel, decode_features

TRUE = NominalStepTimes.from_profile(get_profile("a40"))


def test_factor_is_the_conformal_rank_of_the_ratios():
    """With m ratios the factor is the ceil((m+1)q)-th smallest; before min_samples, the
    default."""
    bound = ConformalBound(0.9, window=200, min_samples=10, default_factor=1.7, refresh=1)
    for i in range(9):
        bound.add(float(i + 1), 1.0)
    assert bound.factor() == 1.7
    bound = ConformalBound(0.9, window=200, min_samples=10, refresh=1)
    for i in range(100):
        bound.add((i + 1) / 100.0, 1.0)  # ratios 0.01 .. 1.00
    assert bound.factor() == pytest.approx(0.91)  # ceil(101 * 0.9) = 91st smallest


def test_window_slides():
    """Only the last ``window`` ratios count."""
    bound = ConformalBound(0.9, window=50, min_samples=10, refresh=1)
    for _ in range(50):
        bound.add(5.0, 1.0)
    for _ in range(50):
        bound.add(1.0, 1.0)
    assert bound.count == 50 and bound.factor() == 1.0


def test_invalid_pairs_are_ignored():
    """Non-positive predictions and non-finite values do not enter the window."""
    bound = ConformalBound()
    bound.add(1.0, 0.0)
    bound.add(float("nan"), 1.0)
    bound.add(1.0, float("inf"))
    assert bound.count == 0


def test_p90_covers_about_90_percent_on_held_out_data(rand):
    """A calibrated model's p90 bound, computed before each held-out sample is seen, covers
    it about 90 % of the time (5 % lognormal noise, 2000 held-out decode steps)."""
    model = StepTimeModel(TRUE.scaled(1.2))

    def sample() -> tuple[list[float], float]:
        batch = rand.randint(1, 256)
        f = decode_features(batch, batch * rand.randint(64, 4096))
        y = sum(a * b for a, b in zip(TRUE.coef(), f, strict=True))
        return f, y * math.exp(rand.gauss(0.0, 0.05))

    for _ in range(800):
        f, y = sample()
        model.observe(f, y, kind="decode")
    covered = 0
    n = 2000
    for _ in range(n):
        f, y = sample()
        covered += y <= model.predict(f) * model.p90_factor("decode")
        model.observe(f, y, kind="decode")
    assert 0.86 <= covered / n <= 0.94
    assert 1.03 < model.p90_factor("decode") < 1.12  # ~exp(1.28 * 0.05)
