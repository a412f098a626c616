"""Anomaly scoring and quantised derating with hysteresis (controller.health).

Algorithm: docs/algorithms.md §4.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from controller.health import (
    LEVELS,
    HealthTracker,
    HealthWindow,
    SignalAccumulator,
    peer_groups,
    score_window,
    wilson_lower_bound,
)
from controller.latency import LatencyProfile
from fastroute.config import DeratingConfig
from fastroute.signals.reports import EngineReport, LatencySummary, Report

N = 8
CAP_RPS = 10.0
RHO = 0.5
PROFILE = LatencyProfile.seed(0.05, 0.008)
PRED_TTFT_S = float(np.interp(RHO, PROFILE.breakpoints_rho, PROFILE.ttft_s))
PERIOD_S = 10.0


def config(**kw: float) -> DeratingConfig:
    base = {"min_change_interval_s": 1.0}
    base.update(kw)
    return DeratingConfig(**base)  # type: ignore[arg-type]


def tracker(n: int = N, cfg: DeratingConfig | None = None, **kw: float) -> HealthTracker:
    return HealthTracker(
        [PROFILE] * n,
        np.full(n, CAP_RPS),
        cfg or config(),
        engine_names=[f"e{i}" for i in range(n)],
        **kw,  # type: ignore[arg-type]
    )


def window(
    ttft_factor: dict[int, float] | None = None,
    *,
    n: int = N,
    samples: int = 50,
    errors: dict[int, int] | None = None,
    attempts: int = 50,
) -> HealthWindow:
    """Every engine at ρ = 0.5 with TTFT = profile (× factor), ``samples`` samples each."""
    w = HealthWindow.empty(n)
    factor = np.ones(n)
    for i, f in (ttft_factor or {}).items():
        factor[i] = f
    w.ttft_count[:] = samples
    w.ttft_sum_s[:] = samples * PRED_TTFT_S * factor
    w.attempts[:] = attempts
    for i, k in (errors or {}).items():
        w.errors[i] = k
    w.load_rps[:] = RHO * CAP_RPS
    return w


def drive(t: HealthTracker, windows: list[HealthWindow], t0: float = 0.0) -> list[list[float]]:
    """Feed windows one period apart; return h of every engine after each."""
    out = []
    for k, w in enumerate(windows):
        t.update(w, t0 + (k + 1) * PERIOD_S)
        out.append(t.health.tolist())
    return out


def test_enters_only_after_three_anomalous_windows() -> None:
    """An engine at 3× its profile (peers at 1×) keeps h = 1 for 2 windows, steps to .75 at 3."""
    t = tracker()
    hs = drive(t, [window({2: 3.0})] * 3)
    assert [h[2] for h in hs] == [1.0, 1.0, 0.75]
    assert all(h[i] == 1.0 for h in hs for i in range(N) if i != 2)


def test_exits_only_after_six_healthy_windows() -> None:
    """After derating, h stays at .75 for 5 healthy windows and returns to 1 at the 6th."""
    t = tracker()
    drive(t, [window({2: 3.0})] * 3)
    hs = drive(t, [window()] * 6, t0=100.0)
    assert [h[2] for h in hs] == [0.75] * 5 + [1.0]
    assert "healthy for 6 windows" in (t.state(2)["reason"] or "")


def test_alternating_signal_never_changes_the_level() -> None:
    """Bad/good alternating windows break both streaks: no derating, no flapping."""
    t = tracker()
    hs = drive(t, [window({2: 3.0}), window()] * 20)
    assert all(h[2] == 1.0 for h in hs)
    t2 = tracker()
    drive(t2, [window({2: 3.0})] * 3)
    hs = drive(t2, [window(), window({2: 3.0}), window(), window(), window({2: 3.0})] * 6, 1e3)
    assert all(h[2] == 0.75 for h in hs)


def test_levels_are_quantised_one_step_per_streak() -> None:
    """A persistent anomaly walks down 1 → .75 → .5 → .25 → 0, three windows per step."""
    t = tracker(cfg=config(max_derated_fraction=1.0))
    hs = drive(t, [window({2: 5.0})] * 15)
    seen = [h[2] for h in hs]
    assert set(seen) <= set(LEVELS)
    assert seen[2::3] == [0.75, 0.5, 0.25, 0.0, 0.0]
    assert seen[:2] == [1.0, 1.0] and seen[3:5] == [0.75, 0.75]


def test_min_change_interval_is_respected() -> None:
    """With a 60 s interval and 10 s windows, the second step waits for the interval."""
    t = tracker(cfg=config(min_change_interval_s=60.0, max_derated_fraction=1.0))
    hs = drive(t, [window({2: 5.0})] * 12)
    seen = [h[2] for h in hs]
    assert seen[2] == 0.75  # t = 30 s
    assert seen[5] == 0.75  # t = 60 s: only 30 s after the first change
    assert seen[8] == 0.5  # t = 90 s: streak 6 ≥ 3 and the interval has passed
    assert seen.count(0.5) >= 1 and seen.index(0.5) == 8


def test_cap_on_derated_fraction_most_anomalous_first() -> None:
    """With 4 peers and a 25 % cap, only the worst of three bad engines reaches level 0."""
    t = tracker(n=4 + 4)  # 8 peers of 10 rps: the cap is 20 rps of derated capacity
    bad = {1: 2.0, 4: 6.0, 6: 3.0}
    hs = drive(t, [window(bad)] * 30)
    h = np.array(hs[-1])
    derated = (CAP_RPS * (1.0 - h)).sum() / (CAP_RPS * 8)
    assert derated <= 0.25 + 1e-12
    assert h[4] <= h[6] <= h[1]  # the most anomalous got derated first and most
    assert h[4] < 1.0 and t.capped.any()
    assert set(h.tolist()) <= set(LEVELS)
    # the first step of each was granted in severity order
    t2 = tracker(n=8, cfg=config(max_derated_fraction=0.04))  # room for one .75 step (2.5 rps)
    drive(t2, [window(bad)] * 3)
    assert t2.health.tolist() == [1.0, 1.0, 1.0, 1.0, 0.75, 1.0, 1.0, 1.0]
    assert t2.capped[1] and t2.capped[6] and not t2.capped[4]


def test_thin_windows_count_as_neither() -> None:
    """Windows below the sample minimum neither advance nor break a streak."""
    t = tracker()
    thin = window({2: 3.0}, samples=5, attempts=5)
    hs = drive(t, [window({2: 3.0}), thin, window({2: 3.0}), thin, thin])
    assert [h[2] for h in hs] == [1.0] * 5 and t.bad_windows[2] == 2
    t.update(window({2: 3.0}), 1e3)
    assert t.health[2] == 0.75
    # thin windows alone never change anything, and do not reset a good streak
    t3 = tracker()
    drive(t3, [thin] * 10)
    assert t3.health.tolist() == [1.0] * N and not t3.bad_windows.any()


def test_error_rate_path_derates_and_reports_counts() -> None:
    """20 % engine errors (latency normal) derate after 3 windows; the reason names the rate."""
    t = tracker()
    hs = drive(t, [window(errors={5: 40}, attempts=200)] * 3)
    assert [h[5] for h in hs] == [1.0, 1.0, 0.75]
    reason = t.state(5)["reason"]
    assert reason is not None and "error rate" in reason and "40/200 failed" in reason
    assert "for 3 windows" in reason


def test_reason_names_metric_ratio_load_z_and_windows() -> None:
    """The step-down reason is 'TTFT 3.0× profile at ρ=0.50, z=…, for 3 windows'."""
    t = tracker()
    changes = []
    for k in range(3):
        changes += t.update(window({2: 3.0}), (k + 1) * PERIOD_S)
    assert len(changes) == 1
    c = changes[0]
    assert (c.name, c.old_health, c.new_health, c.at_s) == ("e2", 1.0, 0.75, 30.0)
    assert c.reason.startswith("TTFT 3.0× profile at ρ=0.50, z=")
    assert c.reason.endswith("for 3 windows")
    st = t.state(2)
    assert st["level"] == 0.75 and st["since"] == 30.0 and st["reason"] == c.reason
    assert st["z"] == pytest.approx(np.log(3.0) / 0.1)  # peers agree: MAD floor 0.1


def test_small_group_falls_back_to_profile_residual() -> None:
    """With 2 engines the z is log(r)/0.25 vs the profile: 1.3× is fine, 3× is anomalous."""
    t = tracker(n=2)
    s = t.score(window({0: 1.3, 1: 3.0}, n=2))
    assert not s.robust.any()
    np.testing.assert_allclose(s.z, np.log([1.3, 3.0]) / 0.25)
    assert s.z[0] < 3.0 <= s.z[1]
    assert "vs profile only" in (drive_reason(t, n=2) or "")


def drive_reason(t: HealthTracker, n: int) -> str | None:
    drive(t, [window({1: 3.0}, n=n)] * 3)
    return t.state(1)["reason"]


def test_faster_than_peers_and_tbot_scores() -> None:
    """Only slowness counts; TBOT residuals are scored too and the worse metric wins."""
    w = window({3: 0.3})
    w.tbot_count[:] = 500
    pred_tbot = float(np.interp(RHO, PROFILE.breakpoints_rho, PROFILE.tbot_s))
    w.tbot_sum_s[:] = 500 * pred_tbot
    w.tbot_sum_s[6] *= 4.0
    s = score_window(w, [PROFILE] * N, np.full(N, CAP_RPS), np.zeros(N, dtype=np.intp))
    assert s.z_ttft[3] < 0 and s.z[3] <= 1.5 and s.z[6] >= 3.0 and s.robust.all()
    np.testing.assert_allclose(s.rho, RHO)
    np.testing.assert_allclose(s.ttft_ratio[0], 1.0)
    t = tracker()
    drive(t, [w] * 3)
    assert t.health[3] == 1.0 and t.health[6] == 0.75
    assert (t.state(6)["reason"] or "").startswith("TBOT 4.0× profile")


def test_peer_groups_by_shape_and_wilson_bound() -> None:
    """Peer groups follow the profile shape; the Wilson bound is below the raw rate and 0 at 0."""
    other = LatencyProfile.seed(0.08, 0.012)
    assert peer_groups([PROFILE, other, PROFILE, other]).tolist() == [0, 1, 0, 1]
    lb = wilson_lower_bound([0, 10, 100], [100, 100, 100])
    assert lb[0] == 0.0 and 0.04 < lb[1] < 0.1 and 0.96 < lb[2] <= 1.0
    assert wilson_lower_bound([0], [0])[0] == 0.0


def test_accumulator_sums_workers_and_computes_load() -> None:
    """Two workers' reports merge: counts and sums add, load = Σ attempts / covered s per worker."""
    ids = [101, 202]
    acc = SignalAccumulator(ids)
    now = time.time()

    def summary(count: int, mean_s: float) -> LatencySummary:
        return LatencySummary(count, count * mean_s, mean_s, mean_s, mean_s, mean_s, [])

    def rep(worker: str, attempts: int, window_s: float) -> Report:
        er = EngineReport(
            101,
            attempts=attempts,
            failures={"http_5xx": 2, "rate_limited": 7, "client_error": 1},
            ttft=summary(attempts, 0.1),
        )
        return Report(1, "east", worker, now - window_s, now, [], [er, EngineReport(999)])

    acc.observe(rep("a", 10, 1.0))
    acc.observe(rep("a", 30, 1.0))
    acc.observe(rep("b", 50, 5.0))
    w = acc.drain()
    assert w.attempts.tolist() == [90, 0] and w.errors.tolist() == [6, 0]
    assert w.ttft_count.tolist() == [90, 0]
    assert w.ttft_sum_s[0] == pytest.approx(9.0)
    assert w.load_rps[0] == pytest.approx(40 / 2.0 + 50 / 5.0)
    assert not acc.drain().attempts.any()  # drained


def test_validation() -> None:
    """Mismatched lengths are refused."""
    with pytest.raises(ValueError):
        HealthTracker([PROFILE] * 2, np.ones(3), config())
    with pytest.raises(ValueError):
        HealthTracker([PROFILE] * 2, np.ones(2), config(), group=[0])


def test_restore_returns_a_reprofiled_engine_to_full_health_at_once() -> None:
    """restore(): h back to 1 in one change with the given reason and fresh streaks; with its own
    (3× slower) profile the same latency then scores healthy; no-op at full health."""
    t = tracker(cfg=config(max_derated_fraction=1.0))
    drive(t, [window({2: 3.0})] * 6)
    assert t.health[2] == 0.5
    change = t.restore(2, "re-profiled", 100.0)
    assert change is not None and (change.old_health, change.new_health) == (0.5, 1.0)
    assert t.health[2] == 1.0 and t.state(2)["reason"] == "re-profiled"
    slow = LatencyProfile(PROFILE.breakpoints_rho, PROFILE.ttft_s * 3, PROFILE.tbot_s * 3)
    t.profiles = tuple(slow if i == 2 else p for i, p in enumerate(t.profiles))
    hs = drive(t, [window({2: 3.0})] * 6, t0=200.0)
    assert all(h[2] == 1.0 for h in hs)
    assert t.restore(2, "again", 400.0) is None
