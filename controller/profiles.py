"""Online latency profiles: TTFT and TBOT vs utilisation, fitted per engine group from signals.

Algorithm (docs/controller.md, docs/algorithms.md §1.2). Every engine belongs to one *fit
group* (same hardware, models, region and role: engines expected to behave alike) whose profile
starts as the configured hardware seed (:meth:`LatencyProfile.seed`) and is corrected from observed
``(ρ, TTFT, TBOT)`` windows:

* **Sample.** Per window and engine with at least ``min_latency_samples`` latency samples:
  ``ρ = load / nominal capacity``, the breakpoint bin of ``ρ`` (bin edges halfway between
  breakpoints, as :meth:`LatencyProfile.from_samples`), and the log residual ratio
  ``log(mean observed / seed(ρ))`` for TTFT and TBOT. The seed is evaluated at the sample's own
  ``ρ``, so where in the bin the sample fell does not bias the bin.
* **Robust per window.** Within a (group, bin) the window contributes the *median* over its engines
  (one slow member does not move its group's curve), clipped to ``± clip_log`` around the bin's
  current estimate (a single wild window moves the fit by a bounded amount), weighted by the number
  of engines it summarises.
* **Forget.** All sums decay by ``2^(−1/half_life_windows)`` per window: bounded memory (two
  ``n_groups × (K + 1)`` arrays per signal), and the fit follows slow drift (software upgrades,
  mix changes).
* **Curve.** A bin with decayed weight ≥ ``min_weight`` uses its weighted mean log ratio; bins
  without data take the ratio interpolated between fitted bins (constant beyond them), so a group
  seen only at low load is scaled as a whole rather than kinked. ``TTFT_k = seed_k · e^ratio_k``
  (same for TBOT), then made non-decreasing in ρ (running maximum) and the segment slopes
  convexified (non-decreasing) by :class:`LatencyProfile`.

Signals come from the proxies' in-band reports (:class:`controller.health.HealthWindow`) and from
the controller's own scrapes of the engines' ``/metrics`` (:mod:`controller.scrape`); the caller
excludes derated engines so an anomaly is scored against, not absorbed into, its group's curve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from controller.latency import LatencyProfile

__all__ = ["ProfileFitter"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]


class ProfileFitter:
    """Per-group TTFT / TBOT residual curves against seed profiles, updated once per window.

    Parameters
    ----------
    seeds : sequence of LatencyProfile, length n_groups
        The configured (hardware) profile of each fit group; all share one breakpoint grid.
    group_of_engine : array_like of int, shape (n_engines,)
        Fit group of every engine (``0 … n_groups − 1``).
    capacity_rps : array_like, shape (n_engines,)
        Nominal capacity (req/s at ρ = 1) to turn load into utilisation.
    half_life_windows : float
        Windows after which a sample's weight has halved.
    min_weight : float
        Decayed weight (engine-windows) a bin needs to override the seed.
    clip_log : float
        Largest step (log units) one window may take from a bin's current estimate.
    min_latency_samples : int
        Fewest TTFT (resp. TBOT) samples of an engine in a window for it to count.
    group_names : sequence of str, optional
        For :meth:`state`; default ``group-<i>``.
    """

    def __init__(
        self,
        seeds: Sequence[LatencyProfile],
        group_of_engine: npt.ArrayLike,
        capacity_rps: npt.ArrayLike,
        *,
        half_life_windows: float = 60.0,
        min_weight: float = 3.0,
        clip_log: float = math.log(2.0),
        min_latency_samples: int = 5,
        group_names: Sequence[str] | None = None,
    ) -> None:
        self.seeds = tuple(seeds)
        if not self.seeds:
            raise ValueError("need at least one fit group")
        grid = self.seeds[0].breakpoints_rho
        if any(not np.array_equal(s.breakpoints_rho, grid) for s in self.seeds):
            raise ValueError("all seed profiles must share one breakpoint grid")
        self.group_of_engine = np.array(group_of_engine, dtype=np.intp)  # own copy: split()
        self.capacity_rps = np.asarray(capacity_rps, dtype=np.float64)
        n_g = len(self.seeds)
        if self.group_of_engine.ndim != 1 or self.capacity_rps.shape != self.group_of_engine.shape:
            raise ValueError("group_of_engine and capacity_rps must be 1-D of n_engines entries")
        if self.group_of_engine.size and (
            self.group_of_engine.min() < 0 or self.group_of_engine.max() >= n_g
        ):
            raise ValueError(f"group_of_engine must lie in 0 … {n_g - 1}")
        if not half_life_windows > 0 or not min_weight > 0 or not clip_log > 0:
            raise ValueError("half_life_windows, min_weight and clip_log must be > 0")
        self.grid_rho = grid
        self.decay = 0.5 ** (1.0 / half_life_windows)
        self.min_weight = float(min_weight)
        self.clip_log = float(clip_log)
        self.min_latency_samples = max(1, int(min_latency_samples))
        self.group_names = (
            tuple(group_names)
            if group_names is not None
            else tuple(f"group-{i}" for i in range(n_g))
        )
        if len(self.group_names) != n_g:
            raise ValueError("group_names must have one name per seed")
        shape = (n_g, grid.size)
        self._seed_ttft = np.stack([s.ttft_s for s in self.seeds])
        self._seed_tbot = np.stack([s.tbot_s for s in self.seeds])
        self._w = {"ttft": np.zeros(shape), "tbot": np.zeros(shape)}
        self._s = {"ttft": np.zeros(shape), "tbot": np.zeros(shape)}
        #: Engine-windows accepted per group and bin, never decayed (for the plan).
        self.samples = {"ttft": np.zeros(shape, np.int64), "tbot": np.zeros(shape, np.int64)}
        self.windows_total = 0

    @property
    def n_groups(self) -> int:
        """Number of fit groups."""
        return len(self.seeds)

    def _bin(self, rho: FloatArray) -> IntArray:
        b = self.grid_rho
        return np.searchsorted((b[:-1] + b[1:]) / 2.0, rho, side="right").astype(np.intp)

    def _interp(self, table: FloatArray, grp: IntArray, rho: FloatArray) -> FloatArray:
        """``np.interp(rho_i, grid, table[grp_i])`` for every i at once (clamped to the grid)."""
        b = self.grid_rho
        r = np.clip(rho, b[0], b[-1])
        j = np.clip(np.searchsorted(b, r, side="right") - 1, 0, b.size - 2)
        t = (r - b[j]) / (b[j + 1] - b[j])
        return np.asarray(table[grp, j] * (1.0 - t) + table[grp, j + 1] * t, dtype=np.float64)

    def _estimate(self, kind: str) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
        w, s = self._w[kind], self._s[kind]
        fitted = w >= self.min_weight
        mean = np.divide(s, w, out=np.zeros_like(s), where=w > 0)
        return mean, fitted

    def observe(
        self,
        load_rps: npt.ArrayLike,
        ttft_count: npt.ArrayLike,
        ttft_sum_s: npt.ArrayLike,
        tbot_count: npt.ArrayLike,
        tbot_sum_s: npt.ArrayLike,
        *,
        exclude: npt.ArrayLike | None = None,
    ) -> int:
        """Close one window of per-engine signals (all arrays shape ``(n_engines,)``).

        Parameters
        ----------
        load_rps : array_like
            Observed request rate per engine (req/s).
        ttft_count, ttft_sum_s, tbot_count, tbot_sum_s : array_like
            Latency sample counts and sums (s) in the window.
        exclude : array_like of bool, optional
            Engines not to learn from (derated, unavailable, stale).

        Returns
        -------
        int
            Engine samples (TTFT + TBOT) accepted.
        """
        n = self.group_of_engine.size
        load = np.asarray(load_rps, dtype=np.float64)
        arrays = [np.asarray(a, dtype=np.float64) for a in (ttft_count, ttft_sum_s)]
        arrays += [np.asarray(a, dtype=np.float64) for a in (tbot_count, tbot_sum_s)]
        if load.shape != (n,) or any(a.shape != (n,) for a in arrays):
            raise ValueError(f"every signal array must have shape ({n},)")
        skip = np.zeros(n, bool) if exclude is None else np.asarray(exclude, dtype=bool)
        if skip.shape != (n,):
            raise ValueError(f"exclude must have shape ({n},)")
        for kind in ("ttft", "tbot"):
            self._w[kind] *= self.decay
            self._s[kind] *= self.decay
        self.windows_total += 1
        cap = self.capacity_rps
        ok_rho = np.isfinite(load) & (load >= 0) & (cap > 0) & ~skip
        rho = np.divide(load, cap, out=np.zeros(n), where=ok_rho)
        bins = self._bin(rho)
        grp = self.group_of_engine
        accepted = 0
        for kind, count, total, seed in (
            ("ttft", arrays[0], arrays[1], self._seed_ttft),
            ("tbot", arrays[2], arrays[3], self._seed_tbot),
        ):
            ok = ok_rho & (count >= self.min_latency_samples) & np.isfinite(total) & (total > 0)
            idx = np.flatnonzero(ok)
            if idx.size == 0:
                continue
            pred = self._interp(seed, grp[idx], rho[idx])
            good = pred > 0
            idx, pred = idx[good], pred[good]
            log_ratio = np.log(total[idx] / count[idx] / pred)
            accepted += self._add(kind, grp[idx], bins[idx], log_ratio)
        return accepted

    def _add(self, kind: str, grp: IntArray, bins: IntArray, log_ratio: FloatArray) -> int:
        mean, _ = self._estimate(kind)
        w, s, seen = self._w[kind], self._s[kind], self.samples[kind]
        cell = grp * self.grid_rho.size + bins
        order = np.argsort(cell, kind="stable")
        cell, log_ratio = cell[order], log_ratio[order]
        starts = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
        ends = np.r_[starts[1:], cell.size]
        for a, b in zip(starts, ends, strict=True):  # one iteration per (group, bin) cell
            g, k = divmod(int(cell[a]), self.grid_rho.size)
            value = float(np.median(log_ratio[a:b]))
            if w[g, k] > 0:  # bounded step away from the current estimate
                value = min(max(value, mean[g, k] - self.clip_log), mean[g, k] + self.clip_log)
            weight = float(b - a)
            w[g, k] += weight
            s[g, k] += weight * value
            seen[g, k] += b - a
        return int(cell.size)

    def split(self, engine: int, seed: LatencyProfile, name: str) -> int:
        """Give ``engine`` a fit group of its own, starting from ``seed``; return its index.

        An engine already alone in its group has that group re-seeded in place (its data
        forgotten), so groups never outnumber engines.
        """
        g_old = int(self.group_of_engine[engine])
        if not np.array_equal(seed.breakpoints_rho, self.grid_rho):
            raise ValueError("the seed must use the fitter's breakpoint grid")
        alone = int(np.count_nonzero(self.group_of_engine == g_old)) == 1
        if alone:
            g = g_old
            seeds = list(self.seeds)
            seeds[g] = seed
            self.seeds = tuple(seeds)
            self._seed_ttft[g] = seed.ttft_s
            self._seed_tbot[g] = seed.tbot_s
            names = list(self.group_names)
            names[g] = name
            self.group_names = tuple(names)
            for kind in ("ttft", "tbot"):
                self._w[kind][g] = 0.0
                self._s[kind][g] = 0.0
                self.samples[kind][g] = 0
            return g
        g = self.n_groups
        self.seeds = (*self.seeds, seed)
        self.group_names = (*self.group_names, name)
        self._seed_ttft = np.vstack([self._seed_ttft, seed.ttft_s])
        self._seed_tbot = np.vstack([self._seed_tbot, seed.tbot_s])
        for kind in ("ttft", "tbot"):
            self._w[kind] = np.vstack([self._w[kind], np.zeros(self.grid_rho.size)])
            self._s[kind] = np.vstack([self._s[kind], np.zeros(self.grid_rho.size)])
            self.samples[kind] = np.vstack(
                [self.samples[kind], np.zeros(self.grid_rho.size, np.int64)]
            )
        self.group_of_engine[engine] = g
        return g

    def log_ratio(self, kind: str) -> FloatArray:
        """Fitted ``log(observed / seed)`` per group and breakpoint, gaps interpolated (0: seed)."""
        if kind not in self._w:
            raise ValueError(f"kind must be 'ttft' or 'tbot', got {kind!r}")
        mean, fitted = self._estimate(kind)
        out = np.zeros_like(mean)
        b = self.grid_rho
        for g in range(self.n_groups):
            f = fitted[g]
            if f.any():
                out[g] = np.interp(b, b[f], mean[g, f])
        return out

    def profile(self, group: int) -> LatencyProfile:
        """The fitted profile of fit group ``group`` (the seed until data arrive)."""
        seed = self.seeds[group]
        r_ttft = self.log_ratio("ttft")[group]
        r_tbot = self.log_ratio("tbot")[group]
        if not (r_ttft.any() or r_tbot.any()):
            return seed
        return LatencyProfile(
            seed.breakpoints_rho,
            np.maximum.accumulate(seed.ttft_s * np.exp(r_ttft)),
            np.maximum.accumulate(seed.tbot_s * np.exp(r_tbot)),
            mean_output_tokens=seed.mean_output_tokens,
            gamma=seed.gamma,
        )

    def profiles(self) -> tuple[LatencyProfile, ...]:
        """Fitted profile of every group."""
        return tuple(self.profile(g) for g in range(self.n_groups))

    def state(self) -> list[dict[str, Any]]:
        """JSON-able fit per group: seed vs fitted TTFT / TBOT / slopes and sample counts."""
        out: list[dict[str, Any]] = []
        for g, seed in enumerate(self.seeds):
            fit = self.profile(g)
            members = np.flatnonzero(self.group_of_engine == g)
            out.append(
                {
                    "group": self.group_names[g],
                    "engines": int(members.size),
                    "breakpoints_rho": seed.breakpoints_rho.tolist(),
                    "seed_ttft_s": seed.ttft_s.tolist(),
                    "fitted_ttft_s": fit.ttft_s.tolist(),
                    "seed_tbot_s": seed.tbot_s.tolist(),
                    "fitted_tbot_s": fit.tbot_s.tolist(),
                    "seed_slopes_s": seed.slopes_s.tolist(),
                    "fitted_slopes_s": fit.slopes_s.tolist(),
                    "ttft_samples": self.samples["ttft"][g].tolist(),
                    "tbot_samples": self.samples["tbot"][g].tolist(),
                    "fitted": fit is not seed,
                }
            )
        return out
