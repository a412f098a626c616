"""Anomaly scoring and quantised capacity derating with hysteresis (docs/algorithms.md §4.2–4.3).

Pure: no I/O, no clock of its own (every update takes ``now_s``), O(engines) per window.

**Window.** One control period. :class:`SignalAccumulator` sums the proxies' per-engine report
entries (:class:`fastroute.signals.reports.EngineReport`) over all workers between two drains:
TTFT and TBOT counts and sums (so the window mean is exact over workers), attempts, failures and
the observed load ``λ_e = Σ_workers attempts_we / covered_seconds_w`` (req/s).

**Score** (:func:`score_window`), per engine ``e`` with nominal capacity ``C_e`` and profile ``P``:

* ``ρ_e = λ_e / C_e`` (nominal capacity: the residual compares the engine to a healthy engine of
  its shape at the same load, whatever its current derating), clamped to the profile grid;
* residual ratios ``r = mean observed / P(ρ_e)`` for TTFT and TBOT (mean per request and per output
  chunk; the reports carry no per-engine prompt tokens, so no per-token normalisation yet), each
  only when its summary holds ≥ ``min_latency_samples`` samples;
* robust z-score of ``log r`` within the engine's *peer group* (engines sharing the latency shape,
  i.e. the hardware group; the LP groups split these further by region):
  ``z = (log r − median) / max(1.4826 · MAD, min_scale_log)``. The floor keeps ``z`` finite when
  the peers agree exactly. A peer group with fewer than ``min_robust_group`` (3) engines with
  samples has no meaningful median, so it falls back to the residual vs the profile alone:
  ``z = log r / fallback_scale_log`` (default 0.25: ``z = 3`` at r ≈ 2.1×, ``z = 1.5`` at r ≈
  1.45×). The engine's ``z`` is the larger of the TTFT and TBOT ones (only slowness counts);
* error rate: Wilson lower bound (95 %) of failures / attempts, counting every failure kind except
  ``rate_limited`` and ``client_error`` (load and client faults, not engine faults), only with ≥
  ``min_attempts`` attempts.

**Windows.** A window is *anomalous* if ``z ≥ z_enter`` or the error bound ≥ ``error_rate_enter``;
*healthy* if every signal with enough samples is good (``z ≤ z_exit``, error bound ≤
``error_rate_exit``); otherwise (in the band between) it breaks both streaks. A *thin* window (no
signal with enough samples) counts as neither and leaves both streaks as they were.

**Levels** ``h ∈ {0, .25, .5, .75, 1}`` (:data:`LEVELS`). One step down after ``enter_windows``
consecutive anomalous windows, one step up after ``exit_windows`` consecutive healthy ones; a step
resets both streaks (the next step needs a fresh streak) and no engine changes twice within
``min_change_interval_s``. Step-downs are granted most anomalous first (severity =
``max(z / z_enter, error bound / error_rate_enter)``) while the derated capacity
``Σ C_i (1 − h_i)`` of the peer group stays ≤ ``max_derated_fraction · Σ C_i``; an engine refused by
the cap keeps its streak and is marked ``capped``. Level 0 means the engine gets no traffic (the
service flags it ``FLAG_UNAVAILABLE``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from controller.latency import LatencyProfile
from fastroute.config import DeratingConfig
from fastroute.signals.reports import Report

__all__ = [
    "LEVELS",
    "NON_FAULT_FAILURE_KINDS",
    "HealthTracker",
    "HealthWindow",
    "LevelChange",
    "SignalAccumulator",
    "WindowScore",
    "peer_groups",
    "score_window",
    "wilson_lower_bound",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

#: Health factors, index = level (4 = healthy).
LEVELS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
_TOP = len(LEVELS) - 1
#: Failure kinds that do not count as engine errors.
NON_FAULT_FAILURE_KINDS: frozenset[str] = frozenset({"rate_limited", "client_error"})
#: 1.4826 · MAD estimates σ for normal data.
MAD_TO_SIGMA = 1.4826


def wilson_lower_bound(
    errors: npt.ArrayLike, attempts: npt.ArrayLike, z: float = 1.96
) -> FloatArray:
    """Wilson score lower bound of the error rate (0 where ``attempts`` is 0).

    Parameters
    ----------
    errors, attempts : array_like of int
        Failed and total attempts.
    z : float
        Normal quantile (1.96: 95 % two-sided).
    """
    k = np.asarray(errors, dtype=np.float64)
    n = np.asarray(attempts, dtype=np.float64)
    safe_n = np.maximum(n, 1.0)
    p = np.clip(k / safe_n, 0.0, 1.0)
    z2 = z * z
    centre = p + z2 / (2.0 * safe_n)
    spread = z * np.sqrt(p * (1.0 - p) / safe_n + z2 / (4.0 * safe_n * safe_n))
    lb = (centre - spread) / (1.0 + z2 / safe_n)
    return np.where(n > 0, np.clip(lb, 0.0, 1.0), 0.0)


def peer_groups(profiles: Sequence[LatencyProfile], decimals: int = 9) -> npt.NDArray[np.intp]:
    """Peer-group index per engine: engines with the same latency shape, numbered by first use."""
    ids: dict[tuple[float, ...], int] = {}
    return np.array([ids.setdefault(p.shape_key(decimals), len(ids)) for p in profiles], np.intp)


@dataclass(frozen=True, eq=False)
class HealthWindow:
    """One window of per-engine signals, all arrays shape ``(n_engines,)``.

    Attributes
    ----------
    ttft_count, tbot_count : ndarray of int64
        Latency samples.
    ttft_sum_s, tbot_sum_s : ndarray
        Their sums (s).
    attempts, errors : ndarray of int64
        Upstream attempts and those that failed with an engine fault.
    load_rps : ndarray
        Observed request rate (req/s).
    """

    ttft_count: IntArray
    ttft_sum_s: FloatArray
    tbot_count: IntArray
    tbot_sum_s: FloatArray
    attempts: IntArray
    errors: IntArray
    load_rps: FloatArray

    @classmethod
    def empty(cls, n_engines: int) -> HealthWindow:
        """A window without any samples."""
        zi = np.zeros(n_engines, dtype=np.int64)
        zf = np.zeros(n_engines, dtype=np.float64)
        return cls(zi, zf, zi.copy(), zf.copy(), zi.copy(), zi.copy(), zf.copy())


class SignalAccumulator:
    """Sums proxy reports per engine between two :meth:`drain` calls (one window).

    Parameters
    ----------
    engine_ids : sequence of int
        The fleet's engine ids, column order; report entries of other ids are ignored.
    """

    def __init__(self, engine_ids: Sequence[int]) -> None:
        self._index = {int(e): i for i, e in enumerate(engine_ids)}
        self._n = len(self._index)
        self._reset()

    def _reset(self) -> None:
        self._win = HealthWindow.empty(self._n)
        self._attempts_by_worker: dict[str, dict[int, int]] = {}
        self._covered_s: dict[str, float] = {}

    def observe(self, report: Report) -> None:
        """Add one report's engine entries (O(engines in the report))."""
        w = self._win
        per_engine = self._attempts_by_worker.setdefault(report.worker_id, {})
        self._covered_s[report.worker_id] = self._covered_s.get(report.worker_id, 0.0) + max(
            report.window_s, 0.0
        )
        for er in report.engines:
            i = self._index.get(er.engine_id)
            if i is None:
                continue
            per_engine[i] = per_engine.get(i, 0) + er.attempts
            w.attempts[i] += er.attempts
            w.errors[i] += sum(
                n for kind, n in er.failures.items() if kind not in NON_FAULT_FAILURE_KINDS
            )
            if er.ttft is not None:
                w.ttft_count[i] += er.ttft.count
                w.ttft_sum_s[i] += er.ttft.sum_s
            if er.tbot is not None:
                w.tbot_count[i] += er.tbot.count
                w.tbot_sum_s[i] += er.tbot.sum_s

    def drain(self) -> HealthWindow:
        """The window since the last drain, with ``load_rps`` filled in; starts a new one."""
        w = self._win
        for worker, per_engine in self._attempts_by_worker.items():
            covered = self._covered_s.get(worker, 0.0)
            if covered <= 0:
                continue
            for i, n in per_engine.items():
                w.load_rps[i] += n / covered
        self._reset()
        return w


@dataclass(frozen=True, eq=False)
class WindowScore:
    """Scores of one window, arrays shape ``(n_engines,)``.

    Attributes
    ----------
    rho : ndarray
        Observed utilisation ``λ / C`` (nominal capacity).
    ttft_ratio, tbot_ratio : ndarray
        Observed / profile mean (NaN without enough samples).
    z_ttft, z_tbot : ndarray
        Robust z-scores (NaN without enough samples).
    z : ndarray
        ``max(z_ttft, z_tbot)`` over the valid ones (NaN if neither).
    robust : ndarray of bool
        The z came from the peer median/MAD (else from the profile-only fallback).
    error_rate_lb : ndarray
        Wilson lower bound of the error rate (NaN without enough attempts).
    latency_valid, errors_valid : ndarray of bool
    """

    rho: FloatArray
    ttft_ratio: FloatArray
    tbot_ratio: FloatArray
    z_ttft: FloatArray
    z_tbot: FloatArray
    z: FloatArray
    robust: BoolArray
    error_rate_lb: FloatArray
    latency_valid: BoolArray
    errors_valid: BoolArray


def _robust_z(
    log_r: FloatArray,
    valid: BoolArray,
    group: npt.NDArray[np.intp],
    n_groups: int,
    *,
    min_robust_group: int,
    min_scale_log: float,
    fallback_scale_log: float,
) -> tuple[FloatArray, BoolArray]:
    z = np.full(log_r.shape, np.nan)
    robust = np.zeros(log_r.shape, dtype=bool)
    idx = np.flatnonzero(valid)
    if idx.size == 0:
        return z, robust
    g = group[idx]
    order = np.argsort(g, kind="stable")
    bounds = np.searchsorted(g[order], np.arange(n_groups + 1))
    for j in range(n_groups):
        members = idx[order[bounds[j] : bounds[j + 1]]]
        if members.size == 0:
            continue
        x = log_r[members]
        if members.size >= min_robust_group:
            med = float(np.median(x))
            scale = max(MAD_TO_SIGMA * float(np.median(np.abs(x - med))), min_scale_log)
            z[members] = (x - med) / scale
            robust[members] = True
        else:
            z[members] = x / fallback_scale_log
    return z, robust


def score_window(
    window: HealthWindow,
    profiles: Sequence[LatencyProfile],
    capacity_rps: npt.ArrayLike,
    group: npt.ArrayLike,
    *,
    min_latency_samples: int = 20,
    min_attempts: int = 20,
    min_robust_group: int = 3,
    min_scale_log: float = 0.1,
    fallback_scale_log: float = 0.25,
) -> WindowScore:
    """Residual ratios, robust z-scores and error-rate bounds of one window (see module doc).

    Parameters
    ----------
    window : HealthWindow
    profiles : sequence of LatencyProfile, length n_engines
    capacity_rps : array_like, shape (n_engines,)
        Nominal capacity (req/s at ρ = 1).
    group : array_like of int, shape (n_engines,)
        Peer group per engine (:func:`peer_groups`).
    min_latency_samples, min_attempts : int
        Fewest TTFT/TBOT samples, resp. attempts, for that signal to count.
    min_robust_group : int
        Fewest engines with samples in a peer group for the median/MAD score.
    min_scale_log, fallback_scale_log : float
        Floor of the robust scale, and the scale of the profile-only fallback (log units).
    """
    cap = np.asarray(capacity_rps, dtype=np.float64)
    grp = np.asarray(group, dtype=np.intp)
    n = cap.size
    rho = np.divide(window.load_rps, cap, out=np.zeros(n), where=cap > 0)
    pred_ttft = np.empty(n)
    pred_tbot = np.empty(n)
    by_profile: dict[int, list[int]] = {}
    for i, p in enumerate(profiles):
        by_profile.setdefault(id(p), []).append(i)
    for members in by_profile.values():
        p = profiles[members[0]]
        r = rho[members]
        pred_ttft[members] = np.interp(r, p.breakpoints_rho, p.ttft_s)
        pred_tbot[members] = np.interp(r, p.breakpoints_rho, p.tbot_s)
    n_groups = int(grp.max(initial=-1)) + 1
    kw: dict[str, Any] = {
        "min_robust_group": min_robust_group,
        "min_scale_log": min_scale_log,
        "fallback_scale_log": fallback_scale_log,
    }

    def ratio(count: IntArray, sum_s: FloatArray, pred: FloatArray) -> tuple[FloatArray, BoolArray]:
        ok = (count >= max(1, min_latency_samples)) & (pred > 0) & (sum_s > 0)
        mean = np.divide(sum_s, count, out=np.zeros(n), where=count > 0)
        return np.where(ok, np.divide(mean, pred, out=np.ones(n), where=ok), np.nan), ok

    r_ttft, ok_ttft = ratio(window.ttft_count, window.ttft_sum_s, pred_ttft)
    r_tbot, ok_tbot = ratio(window.tbot_count, window.tbot_sum_s, pred_tbot)
    with np.errstate(divide="ignore", invalid="ignore"):
        z_ttft, rob_ttft = _robust_z(np.log(r_ttft), ok_ttft, grp, n_groups, **kw)
        z_tbot, rob_tbot = _robust_z(np.log(r_tbot), ok_tbot, grp, n_groups, **kw)
    latency_valid = ok_ttft | ok_tbot
    z = np.fmax(z_ttft, z_tbot)  # NaN only where both are NaN
    errors_valid = window.attempts >= max(1, min_attempts)
    lb = np.where(errors_valid, wilson_lower_bound(window.errors, window.attempts), np.nan)
    return WindowScore(
        rho=rho,
        ttft_ratio=r_ttft,
        tbot_ratio=r_tbot,
        z_ttft=z_ttft,
        z_tbot=z_tbot,
        z=z,
        robust=np.where(ok_ttft, rob_ttft, rob_tbot),
        error_rate_lb=lb,
        latency_valid=latency_valid,
        errors_valid=errors_valid,
    )


@dataclass(frozen=True)
class LevelChange:
    """One derating step.

    Attributes
    ----------
    engine : int
        Engine index.
    name : str
    old_health, new_health : float
        Levels from :data:`LEVELS`.
    reason : str
        E.g. ``"TTFT 3.1× profile at ρ=0.60, z=4.2, for 3 windows"``.
    at_s : float
        Clock time of the change (s).
    """

    engine: int
    name: str
    old_health: float
    new_health: float
    reason: str
    at_s: float


class HealthTracker:
    """Per-engine derating state machine (see module doc).

    Parameters
    ----------
    profiles : sequence of LatencyProfile, length n_engines
        Each engine's profile (the prediction at its observed load).
    capacity_rps : array_like, shape (n_engines,)
        Nominal capacity.
    config : DeratingConfig
        Thresholds, streak lengths, change interval and the derated-capacity cap.
    engine_names : sequence of str, optional
        For reasons and :class:`LevelChange`; default ``engine-<i>``.
    group : array_like of int, optional
        Peer group per engine; default :func:`peer_groups` of ``profiles``.
    min_latency_samples, min_attempts, min_robust_group, min_scale_log, fallback_scale_log
        See :func:`score_window`.
    """

    def __init__(
        self,
        profiles: Sequence[LatencyProfile],
        capacity_rps: npt.ArrayLike,
        config: DeratingConfig,
        *,
        engine_names: Sequence[str] | None = None,
        group: npt.ArrayLike | None = None,
        min_latency_samples: int = 20,
        min_attempts: int = 20,
        min_robust_group: int = 3,
        min_scale_log: float = 0.1,
        fallback_scale_log: float = 0.25,
    ) -> None:
        self.profiles = tuple(profiles)
        self.capacity_rps = np.asarray(capacity_rps, dtype=np.float64)
        n = self.capacity_rps.size
        if len(self.profiles) != n or self.capacity_rps.ndim != 1:
            raise ValueError("profiles and capacity_rps must have n_engines entries")
        self.config = config
        self.engine_names = (
            tuple(engine_names)
            if engine_names is not None
            else tuple(f"engine-{i}" for i in range(n))
        )
        self.group = (
            peer_groups(self.profiles) if group is None else np.asarray(group, dtype=np.intp)
        )
        if self.group.shape != (n,) or len(self.engine_names) != n:
            raise ValueError("group and engine_names must have n_engines entries")
        self._score_kw: dict[str, Any] = {
            "min_latency_samples": min_latency_samples,
            "min_attempts": min_attempts,
            "min_robust_group": min_robust_group,
            "min_scale_log": min_scale_log,
            "fallback_scale_log": fallback_scale_log,
        }
        self._n_groups = int(self.group.max(initial=-1)) + 1
        self._group_capacity_rps = np.bincount(self.group, self.capacity_rps, self._n_groups)
        #: Level index per engine (``LEVELS[level]`` is h).
        self.level = np.full(n, _TOP, dtype=np.intp)
        self.bad_windows = np.zeros(n, dtype=np.int64)
        self.good_windows = np.zeros(n, dtype=np.int64)
        self.changed_at_s = np.full(n, -math.inf)
        self.capped = np.zeros(n, dtype=bool)
        self.reasons: list[str | None] = [None] * n
        self.last_score: WindowScore | None = None
        self.windows_total = 0

    # -- views ----------------------------------------------------------------------------------

    @property
    def health(self) -> FloatArray:
        """Health factor ``h`` per engine."""
        return np.asarray(LEVELS, dtype=np.float64)[self.level]

    def derated_fraction(self) -> FloatArray:
        """Derated capacity ``Σ C (1 − h) / Σ C`` per peer group."""
        derated = np.bincount(self.group, self.capacity_rps * (1.0 - self.health), self._n_groups)
        return np.divide(
            derated,
            self._group_capacity_rps,
            out=np.zeros(self._n_groups),
            where=self._group_capacity_rps > 0,
        )

    def state(self, i: int) -> dict[str, Any]:
        """JSON-able derating state of engine ``i`` (for ``GET /v1/plan``)."""
        s = self.last_score

        def num(a: FloatArray | None) -> float | None:
            if a is None or not math.isfinite(float(a[i])):
                return None
            return float(a[i])

        since = float(self.changed_at_s[i])
        return {
            "level": float(LEVELS[self.level[i]]),
            "reason": self.reasons[i],
            "since": since if math.isfinite(since) else None,
            "bad_windows": int(self.bad_windows[i]),
            "good_windows": int(self.good_windows[i]),
            "capped": bool(self.capped[i]),
            "z": num(None if s is None else s.z),
            "ttft_ratio": num(None if s is None else s.ttft_ratio),
            "tbot_ratio": num(None if s is None else s.tbot_ratio),
            "rho": num(None if s is None else s.rho),
            "error_rate_lb": num(None if s is None else s.error_rate_lb),
        }

    # -- one window -----------------------------------------------------------------------------

    def score(self, window: HealthWindow) -> WindowScore:
        """:func:`score_window` with this tracker's profiles, capacities and groups."""
        return score_window(window, self.profiles, self.capacity_rps, self.group, **self._score_kw)

    def update(self, window: HealthWindow, now_s: float) -> list[LevelChange]:
        """Score ``window``, advance the streaks and apply level changes; return the changes."""
        cfg = self.config
        s = self.score(window)
        self.last_score = s
        self.windows_total += 1
        z = np.where(s.latency_valid, s.z, -np.inf)
        lb = np.where(s.errors_valid, s.error_rate_lb, 0.0)
        lat_bad = s.latency_valid & (z >= cfg.z_enter)
        err_bad = s.errors_valid & (lb >= cfg.error_rate_enter)
        bad = lat_bad | err_bad
        good = (
            ~bad
            & (s.latency_valid | s.errors_valid)
            & (~s.latency_valid | (z <= cfg.z_exit))
            & (~s.errors_valid | (lb <= cfg.error_rate_exit))
        )
        counted = s.latency_valid | s.errors_valid  # thin windows leave the streaks alone
        self.bad_windows = np.where(
            counted, np.where(bad, self.bad_windows + 1, 0), self.bad_windows
        )
        self.good_windows = np.where(
            counted, np.where(good, self.good_windows + 1, 0), self.good_windows
        )
        ready = now_s - self.changed_at_s >= cfg.min_change_interval_s
        down = np.flatnonzero(ready & (self.bad_windows >= cfg.enter_windows) & (self.level > 0))
        up = np.flatnonzero(ready & (self.good_windows >= cfg.exit_windows) & (self.level < _TOP))
        self.capped[:] = False
        changes: list[LevelChange] = []
        if down.size:
            severity = np.fmax(
                np.where(s.latency_valid, z / cfg.z_enter, 0.0),
                np.where(s.errors_valid, lb / cfg.error_rate_enter, 0.0),
            )
            derated = self._group_capacity_rps * self.derated_fraction()
            limit = cfg.max_derated_fraction * self._group_capacity_rps
            for i in down[np.argsort(-severity[down], kind="stable")]:
                g = self.group[i]
                step = self.capacity_rps[i] * (LEVELS[self.level[i]] - LEVELS[self.level[i] - 1])
                if derated[g] + step > limit[g] * (1.0 + 1e-9) + 1e-12:
                    self.capped[i] = True
                    continue
                derated[g] += step
                reason = self._down_reason(int(i), s, bool(lat_bad[i]), bool(err_bad[i]), window)
                changes.append(self._change(int(i), -1, reason, now_s))
        for i in up:
            changes.append(self._change(int(i), +1, self._up_reason(int(i), s), now_s))
        return changes

    def restore(self, i: int, reason: str, now_s: float) -> LevelChange | None:
        """Return engine ``i`` to full health at once (it was re-profiled: a stable latency shift
        is a different curve, priced by the LP, not an anomaly); streaks restart.

        The caller gives the engine its own profile first (``profiles``). Returns the change, or
        None when the engine already was at full health.
        """
        if self.level[i] == _TOP:
            self.bad_windows[i] = 0
            self.good_windows[i] = 0
            return None
        return self._change(i, _TOP - int(self.level[i]), reason, now_s)

    def _change(self, i: int, delta: int, reason: str, now_s: float) -> LevelChange:
        old = LEVELS[self.level[i]]
        self.level[i] += delta
        self.bad_windows[i] = 0
        self.good_windows[i] = 0
        self.changed_at_s[i] = now_s
        self.reasons[i] = reason
        return LevelChange(i, self.engine_names[i], old, LEVELS[self.level[i]], reason, now_s)

    def _down_reason(
        self, i: int, s: WindowScore, lat_bad: bool, err_bad: bool, window: HealthWindow
    ) -> str:
        n = int(self.bad_windows[i])
        parts = []
        if lat_bad:
            parts.append(self._latency_text(i, s))
        if err_bad:
            parts.append(
                f"error rate ≥ {s.error_rate_lb[i]:.1%} "
                f"({int(window.errors[i])}/{int(window.attempts[i])} failed)"
            )
        return ", ".join(parts) + f", for {n} windows"

    def _up_reason(self, i: int, s: WindowScore) -> str:
        n = int(self.good_windows[i])
        detail = self._latency_text(i, s) if s.latency_valid[i] else "errors below bound"
        return f"healthy for {n} windows ({detail})"

    @staticmethod
    def _latency_text(i: int, s: WindowScore) -> str:
        use_tbot = not math.isfinite(s.z_ttft[i]) or (
            math.isfinite(s.z_tbot[i]) and s.z_tbot[i] > s.z_ttft[i]
        )
        metric, ratio = ("TBOT", s.tbot_ratio[i]) if use_tbot else ("TTFT", s.ttft_ratio[i])
        basis = "" if s.robust[i] else " (vs profile only)"
        return f"{metric} {ratio:.1f}× profile at ρ={s.rho[i]:.2f}, z={s.z[i]:.1f}{basis}"
