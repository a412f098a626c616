"""Demand forecast from proxy reports (controller.demand) and the class-key formula."""

from __future__ import annotations

import numpy as np
import pytest

from controller.demand import DemandForecaster, carry_forecast
from fastroute.signals.reports import ClassDemand, Report

KEYS = [11, 22, 33]
CLUSTERS = ["east", "east", "west"]
DEFAULT = np.array([5.0, 5.0, 5.0])
FLOOR = np.array([0.1, 0.1, 0.1])


def _report(worker: str, cluster: str, window_s: float, **requests: int) -> Report:
    classes = [ClassDemand(class_key=int(k[1:]), requests=n) for k, n in requests.items()]
    return Report(1, cluster, worker, 100.0, 100.0 + window_s, classes, [])


def _forecaster(**kw: float) -> DemandForecaster:
    return DemandForecaster(KEYS, CLUSTERS, period_s=1.0, **kw)


def test_defaults_before_any_report_and_floor() -> None:
    """Defaults before any report and floor."""
    f = _forecaster()
    f.update(0.0)
    np.testing.assert_array_equal(f.forecast(DEFAULT, FLOOR), DEFAULT)
    np.testing.assert_array_equal(f.forecast([0.0, 0.0, 0.0], FLOOR), FLOOR)


def test_rates_sum_over_workers_and_only_reporting_clusters_are_measured() -> None:
    """Rates sum over workers and only reporting clusters are measured."""
    f = _forecaster()
    f.observe(_report("a", "east", 0.5, k11=5), 10.0)
    f.observe(_report("a", "east", 0.5, k11=5), 10.5)  # 10 requests in 1 s: 10 rps
    f.observe(_report("b", "east", 2.0, k11=8, k22=4), 10.5)  # 4 rps and 2 rps
    f.update(11.0)
    est = f.forecast(DEFAULT, FLOOR)
    np.testing.assert_allclose(est, [14.0, 2.0, 5.0])  # west never reported: default
    assert f.measured.tolist() == [True, True, False]
    assert f.live_workers == 2


def test_silent_class_of_a_reporting_cluster_falls_to_the_floor() -> None:
    """Silent class of a reporting cluster falls to the floor."""
    f = _forecaster(alpha=1.0, peak_periods=1)
    f.observe(_report("a", "east", 1.0, k11=3), 0.0)
    f.update(0.5)
    np.testing.assert_allclose(f.forecast(DEFAULT, FLOOR), [3.0, 0.1, 5.0])


def test_peak_follows_a_rise_at_once_and_ewma_a_fall_slowly() -> None:
    """Peak follows a rise at once and ewma a fall slowly (no dead band)."""
    f = _forecaster(alpha=0.5, peak_periods=2, deadband_z=0.0)
    t = 0.0
    for n in (10, 10, 40):  # rise
        t += 1.0
        f.observe(_report("a", "east", 1.0, k11=n), t)
        f.update(t)
    assert f.forecast(DEFAULT, FLOOR)[0] == pytest.approx(40.0)  # the peak, not the EWMA (25)
    seen = []
    for _ in range(4):  # fall to 0
        t += 1.0
        f.observe(_report("a", "east", 1.0, k11=0), t)
        f.update(t)
        seen.append(f.forecast(DEFAULT, FLOOR)[0])
    assert seen[0] == pytest.approx(40.0)  # still within the peak window
    assert seen[1] == pytest.approx(6.25)  # EWMA: 25 → 12.5 → 6.25
    assert seen[2] == pytest.approx(3.125) and seen[3] == pytest.approx(1.5625)


def test_worker_without_new_report_keeps_its_rate_until_stale() -> None:
    """Worker without new report keeps its rate until stale."""
    f = _forecaster(alpha=1.0, peak_periods=1, stale_periods=3.0)
    f.observe(_report("a", "east", 1.0, k11=6), 0.0)
    f.update(1.0)
    f.update(2.0)  # no new report: same rate
    assert f.forecast(DEFAULT, FLOOR)[0] == pytest.approx(6.0)
    f.update(3.5)  # silent 3.5 s > 3 periods: forgotten; its cluster is no longer measured
    assert f.live_workers == 0
    assert f.forecast(DEFAULT, FLOOR)[0] == pytest.approx(6.0)  # keeps the last forecast
    f.observe(_report("b", "east", 1.0, k11=2), 4.0)
    f.update(4.5)
    assert f.forecast(DEFAULT, FLOOR)[0] == pytest.approx(2.0)  # only the live worker counts


def test_unknown_keys_are_counted_and_ignored() -> None:
    """Unknown keys are counted and ignored."""
    f = _forecaster()
    f.observe(_report("a", "east", 1.0, k99=7, k11=1), 0.0)
    f.update(0.5)
    assert f.unknown_keys_total == 1
    assert f.forecast(DEFAULT, FLOOR)[0] == pytest.approx(1.0)


def test_bad_parameters_are_refused() -> None:
    """Bad parameters are refused."""
    with pytest.raises(ValueError):
        DemandForecaster([1, 1], ["a", "b"], period_s=1.0)
    with pytest.raises(ValueError):
        DemandForecaster([1], ["a", "b"], period_s=1.0)
    with pytest.raises(ValueError):
        DemandForecaster([1], ["a"], period_s=1.0, alpha=0.0)
    with pytest.raises(ValueError):
        _forecaster(deadband_z=-1.0)
    with pytest.raises(ValueError):
        _forecaster().forecast([1.0], [0.0])


def _feed(f: DemandForecaster, counts: list[int], t0: float = 0.0) -> list[float]:
    """One 1 s report of ``counts[i]`` class-11 requests per period; the forecast after each."""
    out = []
    for i, n in enumerate(counts):
        t = t0 + i + 1.0
        f.observe(_report("a", "east", 1.0, k11=n), t)
        f.update(t)
        out.append(float(f.forecast(DEFAULT, FLOOR)[0]))
    return out


def test_dead_band_holds_the_forecast_through_poisson_noise() -> None:
    """Counts within 2 standard errors (√100 = 10) of the held level do not move the forecast."""
    counts = [100, 112, 95, 108, 90, 104, 115, 99, 93, 110]
    held = _feed(_forecaster(alpha=0.3, peak_periods=3), counts)
    assert held == [100.0] * len(counts)
    free = _feed(_forecaster(alpha=0.3, peak_periods=3, deadband_z=0.0), counts)
    assert len(set(free)) > 3  # without the band the forecast chases every sample
    g = _forecaster(alpha=0.3, peak_periods=3)
    _feed(g, counts)
    ewma = float(counts[0])
    for n in counts[1:]:
        ewma = 0.3 * n + 0.7 * ewma
    assert g.level(DEFAULT, FLOOR)[0] == pytest.approx(ewma)  # the level is not held
    f = _forecaster()
    _feed(f, [100])
    assert f.last_stderr_rps[0] == pytest.approx(10.0)


def test_dead_band_is_summed_in_variance_over_workers() -> None:
    """Two workers of 50 requests each: the band is √100 = 10, not √50 + √50."""
    f = _forecaster()
    f.observe(_report("a", "east", 1.0, k11=50), 1.0)
    f.observe(_report("b", "east", 1.0, k11=50), 1.0)
    f.update(1.0)
    assert f.last_stderr_rps[0] == pytest.approx(10.0)


def test_a_real_step_is_followed_at_once_and_a_fall_within_bounded_periods() -> None:
    """A step of 5 standard errors passes at the next update; a fall back, once out of the peak
    window and the EWMA has come down by more than the band."""
    f = _forecaster(alpha=0.3, peak_periods=3)
    seen = _feed(f, [100] * 5 + [150] * 3 + [100] * 8)
    assert seen[4] == 100.0
    assert seen[5] == pytest.approx(150.0)  # the rise: next period
    back = [i for i, v in enumerate(seen) if i > 7 and v < 125.0]
    assert back and back[0] <= 7 + 3 + 3  # peak window (3) + a few EWMA periods


def test_a_small_sustained_step_is_followed_within_bounded_periods() -> None:
    """A rise of 1.5 standard errors (Poisson 100 → 115 per period) is within one period's
    noise, but the recent peak of the noisy counts crosses the band within a few periods."""
    rng = np.random.default_rng(7)
    f = _forecaster(alpha=0.3, peak_periods=3)
    _feed(f, rng.poisson(100, size=20).tolist())
    after = _feed(f, rng.poisson(115, size=10).tolist(), t0=20.0)
    assert max(after) >= 110.0
    assert after[-1] >= 105.0  # and it stays up


def test_silent_class_falls_through_the_band() -> None:
    """A class that stops arriving (0 counts: band of one count) falls to its floor."""
    f = _forecaster(alpha=1.0, peak_periods=1)
    seen = _feed(f, [20, 20, 0, 0])
    assert seen[-1] == pytest.approx(0.1)


def test_carry_forecast_maps_rows_by_class_key() -> None:
    """EWMA, measured flags, peaks and workers move by key; keys not in the new set are dropped."""
    old = DemandForecaster([1, 2, 3], ["a", "a", "a"], period_s=1.0)
    now = 100.0
    classes = [ClassDemand(class_key=k, requests=r) for k, r in ((1, 10), (3, 30))]
    old.observe(Report(1, "a", "w", now - 1.0, now, classes, []), now)
    old.update(now)
    new = DemandForecaster([3, 4, 2], ["a", "a", "a"], period_s=1.0)
    assert carry_forecast(old, new) == 2
    f = new.forecast(np.full(3, 0.5), np.zeros(3))
    np.testing.assert_allclose(f, [30.0, 0.5, 0.0])
    np.testing.assert_array_equal(new.measured, [True, False, True])
    assert new.live_workers == 1
    # the carried worker only counts keys the new forecaster knows
    new.observe(Report(1, "a", "w", now, now + 1.0, classes, []), now + 1.0)
    new.update(now + 1.0)
    assert new.forecast(np.zeros(3), np.zeros(3))[0] == pytest.approx(30.0)


def test_level_is_the_ewma_without_the_peak() -> None:
    """Shed fractions read the EWMA: a one-period spike lifts the forecast, not the level."""
    f = _forecaster(alpha=0.5, peak_periods=3)
    _feed(f, [10, 10, 40])
    assert f.forecast(DEFAULT, FLOOR)[0] == pytest.approx(40.0)  # the peak
    assert f.level(DEFAULT, FLOOR)[0] == pytest.approx(25.0)  # 0.5 * 40 + 0.5 * 10
    assert f.level(DEFAULT, [30.0, 0.1, 0.1])[0] == pytest.approx(30.0)  # the floor still bounds it
    fresh = _forecaster()
    assert fresh.level(DEFAULT, FLOOR)[0] == pytest.approx(DEFAULT[0])  # never measured
