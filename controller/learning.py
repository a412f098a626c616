"""What the controller learns about its fleet each period: derating levels, latency profiles and
the capacity prefix reuse adds.

:class:`FleetLearning` keeps the current :class:`controller.model.FleetModel` (the service plans on
it): at the close of each signal window it scores the engines and steps their health levels
(:class:`controller.health.HealthTracker`), feeds the online profile fit
(:class:`controller.profiles.ProfileFitter`), gives an engine with a stable latency shift a profile
of its own (:meth:`FleetLearning.reprofile`), rates each peer group's prefix-reuse gain from the
engines' token counters (:func:`controller.reuse.group_reuse_gains`), and rebuilds the engine
groups when any of that changed. The LP plans with ``capacity_rps · gain · health``; health
scoring and the profile fit keep the nominal ``capacity_rps`` (a profile fitted at nominal
utilisation already carries the reuse the gain adds to the capacity bound, so the LP's latency
cost of a reused engine is, if anything, under-estimated).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from controller.groups import group_engines
from controller.health import (
    MAD_TO_SIGMA,
    HealthTracker,
    HealthWindow,
    LevelChange,
    SignalAccumulator,
    peer_groups,
)
from controller.latency import LatencyProfile
from controller.model import FleetModel
from controller.options import ControllerOptions
from controller.profiles import ProfileFitter
from controller.reuse import group_reuse_gains, hit_counts
from controller.scrape import ScrapeWindow
from fastroute.config import Config
from fastroute.signals.reports import Report
from fastroute.tables import FLAG_UNAVAILABLE

__all__ = ["FleetLearning"]

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

#: Derating and profile-fit state carried over a reload when the engines and settings are equal.
_LEARNT = (
    "signals",
    "health",
    "fitter",
    "fit_group",
    "fit_profiles",
    "last_window",
    "_shift_log",
    "_shift_windows",
    "reuse_gain",
)


class FleetLearning:
    """Derating levels and fitted latency profiles of one fleet, and the model they imply.

    Parameters
    ----------
    config : Config
        Its engines (fit groups: hardware, models, region, role) and ``controller.derating``.
    model : FleetModel
        The fleet as built from ``config`` (seed profiles, full health).
    options : ControllerOptions
        The profile-fit, re-profiling and health-scoring tunables.

    Attributes
    ----------
    model : FleetModel
        The current model: fitted profiles, groups for the current health levels.
    health : HealthTracker
    fitter : ProfileFitter
    last_window : HealthWindow or None
        The last closed signal window (the ``p-controller`` planner reads its latencies).
    reuse_gain : ndarray, shape (n_engines,)
        Capacity gain of measured prefix reuse per engine (its peer group's; 1 until
        counted), capped at ``controller.max_reuse_gain``.
    """

    def __init__(self, config: Config, model: FleetModel, options: ControllerOptions) -> None:
        m = self.model = model
        self.derating = config.controller.derating
        self.signals = SignalAccumulator(m.engine_ids.tolist())
        # peers = hardware shape, fixed at start: refitted profiles must not regroup the peers
        self.health = HealthTracker(
            m.profiles,
            m.capacity_rps,
            config.controller.derating,
            engine_names=m.engine_names,
            group=peer_groups(m.profiles),
            min_latency_samples=options.health_min_latency_samples,
        )
        fit_keys: dict[tuple[str, ...], int] = {}
        for e in config.engines:
            fit_keys.setdefault(
                (e.hardware, ",".join(sorted(e.models)), e.region, e.role), len(fit_keys)
            )
        self.fit_group = np.array(
            [
                fit_keys[(e.hardware, ",".join(sorted(e.models)), e.region, e.role)]
                for e in config.engines
            ],
            dtype=np.intp,
        )
        first = {int(g): i for i, g in reversed(list(enumerate(self.fit_group)))}
        self.fitter = ProfileFitter(
            [m.profiles[first[g]] for g in range(len(fit_keys))],
            self.fit_group,
            m.capacity_rps,
            half_life_windows=options.profile_half_life_windows,
            group_names=["/".join(k) for k in fit_keys],
        )
        self.profile_deadband = options.profile_deadband
        #: Profile in use per fit group (the seed until a refit passes the deadband).
        self.fit_profiles: list[LatencyProfile] = list(self.fitter.seeds)
        self.profile_updates_total = 0
        self.last_window: HealthWindow | None = None
        self.reprofile_after_windows = (
            4 * self.derating.exit_windows
            if options.reprofile_after_windows is None
            else options.reprofile_after_windows
        )
        if self.reprofile_after_windows < 1:
            raise ValueError("reprofile_after_windows must be >= 1")
        self.reprofile_max_dispersion_log = options.reprofile_max_dispersion_log
        n_e = len(m.engine_names)
        # ring of the last windows' log latency ratios (TTFT, TBOT) while derated for latency
        self._shift_log = np.full((2, n_e, self.reprofile_after_windows), np.nan)
        self._shift_windows = np.zeros(n_e, dtype=np.int64)
        self.reprofiles_total = 0
        self.max_reuse_gain = config.controller.max_reuse_gain
        self.reuse_gain = np.ones(n_e)

    def planned_capacity_rps(self) -> FloatArray:
        """``capacity_rps · reuse_gain`` per engine: what the groups are built on (× health).
        The gain is clipped to this configuration's cap (a reload may carry a higher one)."""
        return self.model.capacity_rps * np.minimum(self.reuse_gain, self.max_reuse_gain)

    def rate_reuse(self, scraped: ScrapeWindow | None) -> bool:
        """Re-rate the reuse gains from ``scraped``'s prefix windows; return whether one moved."""
        if scraped is None or len(scraped.prefix_hits) != self.reuse_gain.size:
            return False
        gain = group_reuse_gains(
            *hit_counts(scraped.prefix_hits), self.health.group, max_gain=self.max_reuse_gain
        )
        if np.array_equal(gain, self.reuse_gain):
            return False
        self.reuse_gain = gain
        return True

    def observe(self, report: Report) -> None:
        """Add one proxy report's per-engine entries to the open signal window."""
        self.signals.observe(report)

    def engine_flags(self) -> npt.NDArray[np.uint8]:
        """``FLAG_UNAVAILABLE`` for engines derated to 0, else 0."""
        return np.where(self.health.health <= 0.0, FLAG_UNAVAILABLE, 0).astype(np.uint8)

    def adopt(self, old: FleetLearning, *, learnt: bool) -> None:
        """Continue ``old``'s counters; with ``learnt`` also its derating state and fitted
        profiles (only valid for the same engines, breakpoints and derating settings)."""
        self.profile_updates_total = old.profile_updates_total
        self.reprofiles_total = old.reprofiles_total
        if not learnt:
            return
        for key in _LEARNT:
            setattr(self, key, getattr(old, key))
        m = self.model
        profiles = tuple(self.fit_profiles[g] for g in self.fit_group)
        groups = group_engines(
            profiles,
            self.planned_capacity_rps(),
            m.eligible,
            m.network_latency_s,
            health=self.health.health,
        )
        self.model = replace(m, profiles=profiles, groups=groups)
        self.health.profiles = profiles

    def close_window(self, now_s: float, scraped: ScrapeWindow | None) -> list[LevelChange]:
        """Close the signal window: derating levels, then the online profile fit.

        On a level change, a re-rated reuse gain or a refitted profile the groups are rebuilt. A
        level or gain change keeps group membership (only ``C · g · h`` changes), so the LP
        structure and its warm start survive; a refit can split or merge groups (the planner
        carries its anchor over, :func:`controller.groups.regroup_rates`). Returns the level
        changes.
        """
        window = self.signals.drain()
        self.last_window = window
        changes = self.health.update(window, now_s)
        refit = self.learn_profiles(window, scraped)
        reprofiled = self.reprofile(now_s)
        changes += reprofiled
        refit = refit or bool(reprofiled)
        rerated = self.rate_reuse(scraped)
        if not changes and not refit and not rerated:
            return changes
        m = self.model
        capacity = self.planned_capacity_rps()
        if refit:  # the matrices are the model's own, unchanged: keep their locations
            groups = group_engines(
                m.profiles, capacity, m.eligible, m.network_latency_s,
                health=self.health.health, location_of_engine=m.groups.location_of_engine,
            )  # fmt: skip
        else:  # a level or gain change keeps membership: skip the classes × engines key build
            groups = m.groups.with_health(capacity, self.health.health)
        self.model = replace(m, groups=groups)
        return changes

    def learn_profiles(self, window: HealthWindow, scraped: ScrapeWindow | None = None) -> bool:
        """Feed one window to the profile fit; swap in group profiles that moved past the deadband.

        Per engine the fit takes the controller's own scrape where it has latency samples (the
        engine-side TTFT / inter-token histograms exclude the network, which the LP adds as
        ``d``; load = completed requests/s), else the proxies' in-band report window.

        Not learnt from: engines below full health, and engines whose window the anomaly score
        did not find normal against their peers (robust ``z > z_exit`` or an error bound above
        ``error_rate_exit``), so an anomaly is scored against its group's curve instead of being
        absorbed into it. Returns whether any profile in use changed (the caller regroups).
        """
        skip = self.health.health < 1.0
        score = self.health.last_score
        if score is not None:
            cfg = self.derating
            with np.errstate(invalid="ignore"):
                skip |= score.robust & (score.z > cfg.z_exit)
                skip |= score.errors_valid & (score.error_rate_lb > cfg.error_rate_exit)
        load = window.load_rps.astype(np.float64)
        ttft_n, ttft_s = window.ttft_count.astype(np.float64), window.ttft_sum_s.copy()
        tbot_n, tbot_s = window.tbot_count.astype(np.float64), window.tbot_sum_s.copy()
        if scraped is not None:
            own = (scraped.ttft_count > 0) & np.isfinite(scraped.load_rps)
            load = np.where(own, scraped.load_rps, load)
            ttft_n = np.where(own, scraped.ttft_count, ttft_n)
            ttft_s = np.where(own, scraped.ttft_sum_s, ttft_s)
            tbot_n = np.where(own, scraped.tbot_count, tbot_n)
            tbot_s = np.where(own, scraped.tbot_sum_s, tbot_s)
        self.fitter.observe(load, ttft_n, ttft_s, tbot_n, tbot_s, exclude=skip)
        changed = False
        for g, fit in enumerate(self.fitter.profiles()):
            cur = self.fit_profiles[g]
            if fit is cur:
                continue
            rel = np.abs(fit.slopes_s - cur.slopes_s) / np.maximum(cur.slopes_s, 1e-12)
            if float(rel.max(initial=0.0)) > self.profile_deadband:
                self.fit_profiles[g] = fit
                changed = True
        if changed:
            self.profile_updates_total += 1
            profiles = tuple(self.fit_profiles[g] for g in self.fit_group)
            self.model = replace(self.model, profiles=profiles)
            self.health.profiles = profiles
            log.info("latency profiles refitted (update %d)", self.profile_updates_total)
        return changed

    def reprofile(self, now_s: float) -> list[LevelChange]:
        """Re-profile engines whose latency shift is stable instead of derating them forever.

        Mechanism (docs/controller.md "Re-profiling"): while an engine is derated and its window
        has latency samples without an error-rate anomaly, the log ratios (observed / its current
        profile) of TTFT and TBOT are kept for the last ``reprofile_after_windows`` windows. When
        that many consecutive windows are all present, the shift is at least 1.25× and their
        robust dispersion is at most ``reprofile_max_dispersion_log``, the engine is a different
        curve, not a fault: it gets a fit group of its own seeded with its group's profile × the
        median ratios (then fitted online like any group), and full health (the LP now prices its
        slower curve: its share falls through the marginal latency, continuously, not by derating
        levels). It leaves its LP group (a new shape), so the LP structure changes once.
        """
        score = self.health.last_score
        if score is None:
            return []
        cfg = self.derating
        derated = self.health.health < 1.0
        with np.errstate(invalid="ignore"):
            err_ok = ~score.errors_valid | (score.error_rate_lb <= cfg.error_rate_exit)
        seen = derated & score.latency_valid & err_ok
        n = self.reprofile_after_windows
        slot = self._shift_windows % n
        idx = np.flatnonzero(seen)
        with np.errstate(divide="ignore", invalid="ignore"):
            self._shift_log[0, idx, slot[idx]] = np.log(score.ttft_ratio[idx])
            self._shift_log[1, idx, slot[idx]] = np.log(score.tbot_ratio[idx])
        self._shift_windows = np.where(seen, self._shift_windows + 1, 0)
        self._shift_log[:, ~seen, :] = np.nan
        changes: list[LevelChange] = []
        for i in np.flatnonzero(self._shift_windows >= n):
            logs = self._shift_log[:, i, :]
            med = np.full(2, np.nan)
            disp = np.full(2, np.nan)
            for k in range(2):
                v = logs[k][np.isfinite(logs[k])]
                if v.size == n:
                    med[k] = float(np.median(v))
                    disp[k] = MAD_TO_SIGMA * float(np.median(np.abs(v - med[k])))
            usable = np.isfinite(med)
            if not usable.any() or np.nanmax(med) < np.log(1.25):
                continue
            if np.any(disp[usable] > self.reprofile_max_dispersion_log):
                continue
            changes.extend(self._split_engine(int(i), np.where(usable, med, 0.0), now_s))
        return changes

    def _split_engine(self, i: int, log_ratio: FloatArray, now_s: float) -> list[LevelChange]:
        m = self.model
        g_old = int(self.fit_group[i])
        base = self.fit_profiles[g_old]
        seed = LatencyProfile(
            base.breakpoints_rho,
            base.ttft_s * float(np.exp(log_ratio[0])),
            base.tbot_s * float(np.exp(log_ratio[1])),
            mean_output_tokens=base.mean_output_tokens,
            gamma=base.gamma,
        )
        name = f"{self.fitter.group_names[g_old].split('+')[0]}+{m.engine_names[i]}"
        g = self.fitter.split(i, seed, name)
        if g == len(self.fit_profiles):
            self.fit_profiles.append(seed)
        else:
            self.fit_profiles[g] = seed
        self.fit_group[i] = g
        profiles = tuple(self.fit_profiles[k] for k in self.fit_group)
        self.model = replace(m, profiles=profiles)
        self.health.profiles = profiles
        self._shift_windows[i] = 0
        self._shift_log[:, i, :] = np.nan
        self.reprofiles_total += 1
        shift = ", ".join(
            f"{label} {np.exp(v):.2f}×"
            for label, v in (("TTFT", log_ratio[0]), ("TBOT", log_ratio[1]))
            if v != 0.0
        )
        reason = (
            f"re-profiled: stable shift ({shift} its group) for "
            f"{self.reprofile_after_windows} windows; own profile"
        )
        log.warning("engine %s %s", m.engine_names[i], reason)
        change = self.health.restore(i, reason, now_s)
        return [] if change is None else [change]
