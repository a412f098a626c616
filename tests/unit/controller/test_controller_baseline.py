"""The p-controller baseline as a table policy: per-class rows, eligibility, missing data."""

from __future__ import annotations

import numpy as np
import pytest

from controller.baseline import BaselinePolicy, window_latency_s
from controller.health import HealthWindow
from controller.latency import LatencyProfile

NAMES = ["a", "b", "c"]


def test_slow_engine_loses_weight_in_every_class_that_can_use_it() -> None:
    """Engine b 2× slower: its weight falls period after period; rows stay normalised and
    ineligible engines stay at 0."""
    elig = np.array([[True, True, True], [False, True, True]])
    pol = BaselinePolicy(elig, NAMES, gain=0.3, ewma_alpha=1.0)
    w0 = pol.weights()
    assert np.allclose(w0, [[1 / 3] * 3, [0, 0.5, 0.5]])
    history = [w0]
    for t in range(5):
        history.append(pol.step([1.0, 2.0, 1.0], float(t)))
    b = [w[:, 1] for w in history]
    assert all(np.all(b[i + 1] < b[i]) for i in range(5))
    last = history[-1]
    assert np.allclose(last.sum(axis=1), 1.0) and last[1, 0] == 0.0


def test_unobserved_engines_are_neutral_and_unavailable_ones_dropped() -> None:
    """NaN latency (no samples) keeps the last value or the class mean; no data holds the row;
    an unavailable engine is removed from the published row only."""
    pol = BaselinePolicy(np.ones((1, 3), bool), NAMES, gain=0.5, ewma_alpha=1.0)
    held = pol.step([np.nan, np.nan, np.nan], 0.0)
    assert np.allclose(held, 1 / 3)
    w = pol.step([1.0, np.nan, 3.0], 1.0)  # b gets the mean 2.0: no nudge relative to the mean
    assert w[0, 0] > w[0, 1] > w[0, 2]
    w2 = pol.step([np.nan, 2.0, np.nan], 2.0)  # a and c keep their last latencies
    assert w2[0, 0] > w[0, 0] and w2[0, 2] < w[0, 2]
    dropped = pol.weights(available=[True, False, True])
    assert dropped[0, 1] == 0.0 and dropped.sum() == pytest.approx(1.0)


def test_window_latency_adds_decode_time_where_streamed() -> None:
    """L = TTFT + γ · E[N_out] · TBOT; NaN without TTFT samples; TBOT optional."""
    win = HealthWindow.empty(3)
    win.ttft_count[:] = [10, 10, 0]
    win.ttft_sum_s[:] = [1.0, 2.0, 0.0]
    win.tbot_count[:] = [100, 0, 0]
    win.tbot_sum_s[:] = [1.0, 0.0, 0.0]
    prof = LatencyProfile.seed(0.1, 0.01, mean_output_tokens=50.0)
    lat = window_latency_s(win, [prof] * 3)
    assert lat[0] == pytest.approx(0.1 + 50 * 0.01)
    assert lat[1] == pytest.approx(0.2)
    assert np.isnan(lat[2])


def test_shape_errors() -> None:
    """Mismatched eligibility / names and latency vectors raise ValueError."""
    with pytest.raises(ValueError, match="n_engines"):
        BaselinePolicy(np.ones((1, 2), bool), NAMES)
    pol = BaselinePolicy(np.ones((1, 3), bool), NAMES)
    with pytest.raises(ValueError, match="shape"):
        pol.step([1.0, 1.0], 0.0)
