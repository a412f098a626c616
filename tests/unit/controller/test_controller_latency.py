"""Latency profiles: the seed shape, convexified slopes, and fitting to measured samples."""

from __future__ import annotations

import numpy as np
import pytest

from controller.latency import SEED_BREAKPOINTS_RHO, LatencyProfile, segment_slopes


def test_seed_profile_matches_the_reference_formula() -> None:
    """L(ρ) = ttft0/(1−ρ) + 300·tbot0·(1+0.8ρ) on the reference grid."""
    p = LatencyProfile.seed(0.2, 0.02)
    b = np.asarray(SEED_BREAKPOINTS_RHO)
    assert np.allclose(p.latency_s, 0.2 / (1 - b) + 300 * 0.02 * (1 + 0.8 * b))
    assert p.n_segments == 8 and p.rho_max == 0.95
    assert np.allclose(p.widths_rho, np.diff(b))


def test_slopes_are_the_secant_slopes_of_rho_times_latency() -> None:
    """m_k = (b_k L_k − b_{k−1} L_{k−1}) / (b_k − b_{k−1}) when already monotone."""
    p = LatencyProfile.seed(0.05, 0.01)
    phi = p.breakpoints_rho * p.latency_s
    assert np.allclose(p.slopes_s, np.diff(phi) / np.diff(p.breakpoints_rho))
    assert np.allclose(p.cost_per_capacity(p.breakpoints_rho), phi)


def test_convexification_makes_noisy_slopes_non_decreasing() -> None:
    """A measured curve with a bump yields non-decreasing slopes (running maximum)."""
    b = np.asarray(SEED_BREAKPOINTS_RHO)
    lat = 0.1 / (1 - b)
    lat[3] *= 1.6  # a noisy sample at rho = 0.65
    raw = np.diff(b * lat) / np.diff(b)
    assert np.any(np.diff(raw) < 0), "the test needs a non-convex input"
    m = segment_slopes(b, lat)
    assert np.all(np.diff(m) >= 0)
    assert np.all(m >= raw) and m[0] == raw[0]
    assert np.array_equal(m, np.maximum.accumulate(raw))


def test_profile_rejects_a_bad_grid() -> None:
    """Breakpoints must start at 0 and increase strictly."""
    with pytest.raises(ValueError):
        LatencyProfile(np.array([0.1, 0.5]), np.ones(2), np.ones(2))
    with pytest.raises(ValueError):
        LatencyProfile(np.array([0.0, 0.5, 0.5]), np.ones(3), np.ones(3))
    with pytest.raises(ValueError):
        LatencyProfile.seed(0.1, 0.01, breakpoints_rho=[0.0, 0.5, 1.0])


def test_from_samples_scales_dense_bins_and_keeps_the_seed_where_thin(rand) -> None:
    """Well-sampled bins follow the data (here 1.5× the seed); unsampled bins keep the seed."""
    seed = LatencyProfile.seed(0.1, 0.01)
    rho = rand.np.uniform(0.0, 0.55, 2000)  # covers breakpoints 0, .3, .5 only
    ttft = 1.5 * 0.1 / (1 - rho)
    tbot = 1.5 * 0.01 * (1 + 0.8 * rho)
    fit = LatencyProfile.from_samples(rho, ttft, tbot, seed=seed)
    assert np.allclose(fit.ttft_s[:3], 1.5 * seed.ttft_s[:3], rtol=0.03)
    assert np.allclose(fit.tbot_s[:3], 1.5 * seed.tbot_s[:3], rtol=0.03)
    # thin bins fall back to the seed, but never below the fitted lower-load values
    assert np.all(fit.ttft_s[3:] == np.maximum(seed.ttft_s[3:], fit.ttft_s[2]))
    assert np.all(np.diff(fit.ttft_s) >= 0) and np.all(np.diff(fit.slopes_s) >= 0)


def test_from_samples_without_data_is_the_seed() -> None:
    """No samples (or only NaNs) → exactly the seed profile."""
    seed = LatencyProfile.seed(0.1, 0.01)
    fit = LatencyProfile.from_samples([np.nan], [1.0], [1.0], seed=seed)
    assert np.array_equal(fit.latency_s, seed.latency_s)


def test_marginal_latency_is_the_slope_of_the_containing_segment() -> None:
    """marginal_latency_s(ρ) picks m_k for b_{k−1} ≤ ρ < b_k."""
    p = LatencyProfile.seed(0.02, 0.0)
    assert p.marginal_latency_s(0.1) == p.slopes_s[0]
    assert p.marginal_latency_s(0.6) == p.slopes_s[2]
    assert p.marginal_latency_s(0.95) == p.slopes_s[-1]
