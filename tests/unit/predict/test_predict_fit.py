"""The offline step-time fit (relative NNLS) on synthetic points with known coefficients."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from fastroute.hardware import get_profile
from fastroute.predict import COEF_NAMES, NominalStepTimes, decode_features, prefill_features
from fastroute.predict.fit import fit_step_times, nnls, relative_errors
from fastroute.predict.profiles import MEASURED

TRUE = NominalStepTimes.from_profile(get_profile("a40"))
BUDGET = 2048
MEASURED_POINTS = (
    Path(__file__).resolve().parents[3]
    / "docs"
    / "history"
    / "2026-12-03-real-vllm-calibration-second-host.json"
)


def _points() -> list[list[float]]:
    """Prefill (chunked above the budget: later chunks attend to the earlier ones, which
    excites a3) and decode points spanning the features."""
    pf = [prefill_features(n, budget=BUDGET) for n in (16, 128, 512, 1500, 3000, 6000)]
    dec = [decode_features(b, b * ctx) for b, ctx in itertools.product((1, 4, 16), (64, 1024))]
    return pf + dec


def _times(points: list[list[float]], coef: list[float]) -> np.ndarray:
    return np.asarray(points) @ np.asarray(coef)


def test_noise_free_points_give_the_true_coefficients_back():
    points = _points()
    fit = fit_step_times(points, _times(points, TRUE.coef()))
    for name, true in zip(COEF_NAMES, TRUE.coef(), strict=True):
        if name == "m1_s":  # no interleaved prefill: unexcited
            assert fit.coef[name] == 0.0 and name not in fit.fitted
            continue
        assert fit.coef[name] == pytest.approx(true, rel=1e-6), name
    assert fit.max_abs_rel_err < 1e-9


def test_multiplicative_noise_is_fitted_in_relative_terms():
    """5 % lognormal noise: the per-point relative errors are of that size at every scale
    (an absolute fit would spend them on the long prefills and miss the short steps)."""
    rng = np.random.default_rng(3)
    points = _points() * 20
    times = _times(points, TRUE.coef()) * np.exp(rng.normal(0.0, 0.05, len(points)))
    fit = fit_step_times(points, times)
    assert 0.02 < fit.p50_abs_rel_err < 0.05
    assert fit.p90_abs_rel_err < 0.1
    for name in ("a0_s", "a1_s", "b0_s", "b1_s", "b2_s"):
        assert fit.coef[name] == pytest.approx(getattr(TRUE, name), rel=0.15), name
    short = prefill_features(16, budget=BUDGET)
    assert fit.predict(short) == pytest.approx(_times([short], TRUE.coef())[0], rel=0.05)


def test_a_cost_the_data_makes_negative_is_held_at_zero():
    """Decode times flat in B with a falling context cost: least squares would give b2 < 0;
    the fit keeps every cost ≥ 0 and still explains the points as well as it can."""
    points = [decode_features(b, ctx) for b in (1, 2, 4, 8) for ctx in (100, 1000)]
    times = [0.03 - 1e-7 * p[3] for p in points]
    fit = fit_step_times(points, times)
    assert fit.coef["b2_s"] == 0.0
    assert all(fit.coef[n] >= 0.0 for n in COEF_NAMES)
    assert fit.max_abs_rel_err < 0.01


def test_fixed_coefficients_are_kept_and_subtracted():
    points = _points()
    times = _times(points, TRUE.coef())
    fit = fit_step_times(points, times, fixed={"a2_s": TRUE.a2_s, "b2_s": TRUE.b2_s})
    assert fit.coef["a2_s"] == TRUE.a2_s and "a2_s" not in fit.fitted
    assert fit.coef["b1_s"] == pytest.approx(TRUE.b1_s, rel=1e-6)
    assert fit.max_abs_rel_err < 1e-9


def test_nnls_matches_the_best_non_negative_subset():
    """Against brute force: the least-squares solution on every subset of columns that is
    non-negative, the best of them."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(12, 4))
    b = rng.normal(size=12)
    best = math.inf
    for size in range(5):
        for cols in itertools.combinations(range(4), size):
            x = np.zeros(4)
            if cols:
                x[list(cols)] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (x >= 0).all():
                best = min(best, float(np.linalg.norm(a @ x - b)))
    x = nnls(a, b)
    assert (x >= 0).all()
    assert float(np.linalg.norm(a @ x - b)) == pytest.approx(best, rel=1e-9)


def test_relative_errors_sign_and_size():
    features = np.array([[1.0, 0, 0, 0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0, 0, 0]])
    err = relative_errors([0.011, 0, 0, 0, 0, 0, 0, 0], features, np.array([0.01, 0.022]))
    assert err == pytest.approx([0.1, -0.5])


@pytest.mark.parametrize(
    ("features", "times", "fixed"),
    [
        ([[1.0] * 7], [0.1], None),  # 7 features, not 8
        ([[1.0] * 8], [0.1, 0.2], None),  # one point, two times
        ([[1.0] * 8], [0.0], None),  # non-positive time
        ([[1.0] * 8], [0.1], {"z_s": 1.0}),  # unknown coefficient
    ],
)
def test_bad_input_is_refused(features, times, fixed):
    with pytest.raises(ValueError):
        fit_step_times(features, times, fixed=fixed)


def test_the_measured_profile_is_the_fit_of_its_committed_points():
    """``profiles.MEASURED`` is what the fit gives on the raw results it cites, and the
    fit explains those points (docs/predict.md, "Fit on a real vLLM")."""
    raw = json.loads(MEASURED_POINTS.read_text())
    used = [p for p in raw["points"] if p["kind"] != "mixed" and "engine_s" in p]
    features = [
        prefill_features(p["n"], budget=p["budget"])
        if p["kind"] == "prefill"
        else decode_features(p["batch"], p["context"])
        for p in used
    ]
    fit = fit_step_times(features, [p["engine_s"] for p in used])
    profile = MEASURED["cpu-tiny-llama-vllm"]
    for name, value in zip(COEF_NAMES, profile.coef(), strict=True):
        if name == "m1_s":  # not measured: the nominal a1
            assert value == profile.a1_s
            continue
        if name == "a3_s":  # not excited (one chunk per prompt): the mechanism's 2·a2
            assert fit.coef[name] == 0.0 and value == pytest.approx(2 * profile.a2_s)
            continue
        assert value == pytest.approx(fit.coef[name], rel=0.01, abs=1e-12), name
    assert fit.p90_abs_rel_err < 0.1
