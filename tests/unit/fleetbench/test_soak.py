"""The soak's leak test: slopes, their intervals, what counts as a leak."""

from __future__ import annotations

import os
import random

import pytest

from fastroute.fleetbench.soak import (
    ResourceSample,
    fit_slope,
    leak_report,
    proc_resources,
)


def test_fit_slope_recovers_a_line_and_its_noise() -> None:
    ts = [float(t) for t in range(50)]
    slope, stderr = fit_slope(ts, [3.0 + 2.0 * t for t in ts])
    assert slope == pytest.approx(2.0) and stderr == pytest.approx(0.0, abs=1e-9)
    rng = random.Random(1)
    slope, stderr = fit_slope(ts, [5.0 + rng.gauss(0, 1) for _ in ts])
    assert abs(slope) < 3 * stderr  # noise: no slope separated from zero


def _series(role: str, pid: int, values: list[float], step_s: float = 10.0) -> list[ResourceSample]:
    return [ResourceSample(i * step_s, role, pid, "rss_bytes", v) for i, v in enumerate(values)]


def test_leak_report_flags_material_growth_only() -> None:
    rng = random.Random(2)
    n = 180  # 30 minutes at 10 s
    leaking = _series(
        "proxy-worker", 11, [1e8 * (1 + 0.001 * i) + rng.gauss(0, 1e5) for i in range(n)]
    )
    flat = _series("controller", 12, [1e8 + rng.gauss(0, 1e6) for _ in range(n)])
    drifting = _series("engine-e0", 13, [1e8 + 10.0 * i + rng.gauss(0, 1.0) for i in range(n)])
    short = _series("engine-e1", 14, [1e8 * (1 + 0.01 * i) for i in range(20)])
    rows = {r["role"]: r for r in leak_report(leaking + flat + drifting + short, 1800.0)}
    assert rows["proxy-worker"]["leak"] is True and rows["proxy-worker"]["growth"] > 0.05
    assert rows["controller"]["leak"] is False
    # separated from zero but 1.4 kB over 30 min of 100 MB: immaterial
    assert rows["engine-e0"]["leak"] is False
    assert rows["engine-e0"]["slope_per_h"] - rows["engine-e0"]["ci95_per_h"] > 0
    assert "engine-e1" not in rows  # a restarted process's short series is not fitted


def test_proc_resources_reads_this_process() -> None:
    got = proc_resources(os.getpid())
    assert got is not None and got["rss_bytes"] > 1e6 and got["open_fds"] >= 3
    assert proc_resources(2**22 + 7) is None
