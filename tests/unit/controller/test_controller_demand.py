"""Demand forecast from proxy reports (controller.demand) and the class-key formula."""

from __future__ import annotations

import numpy as np
import pytest

from controller.demand import DemandForecaster
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
    """Peak follows a rise at once and ewma a fall slowly."""
    f = _forecaster(alpha=0.5, peak_periods=2)
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
        _forecaster().forecast([1.0], [0.0])
