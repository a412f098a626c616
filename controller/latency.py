"""Latency profiles: per-request latency vs utilisation → convex piecewise-linear LP cost.

Algorithm (docs/controller.md, docs/algorithms.md §1.2). A profile describes one engine *shape*
(hardware × model × anomaly class) on a utilisation grid ``b_0 = 0 < b_1 < … < b_K = ρ_max``:

* ``TTFT(ρ)`` and ``TBOT(ρ)`` in seconds at each breakpoint, and the per-request latency
  ``L(ρ) = TTFT(ρ) + γ · E[N_out] · TBOT(ρ)`` (s);
* the latency *rate* of an engine of effective capacity ``C`` at load ``λ`` is
  ``F(λ) = λ · L(λ / C) = C · φ(λ / C)`` with ``φ(ρ) = ρ · L(ρ)``;
* segment ``k`` covers ``ρ ∈ [b_{k-1}, b_k]`` with slope
  ``m_k = (b_k L(b_k) − b_{k−1} L(b_{k−1})) / (b_k − b_{k−1})`` (s per unit of rate): the marginal
  latency of one more request per second. It does not depend on ``C``, so health derating
  only changes segment widths ``W_k = (b_k − b_{k−1}) · C · h`` and engines of one shape
  aggregate exactly.

Invariant: ``slopes_s`` is non-decreasing (the convex minorant in the sense of the reference: a
running maximum, ``np.maximum.accumulate``), so an LP minimising ``Σ m_k s_k`` fills segments in
order and no binaries are needed. ``ρ_max`` is the largest utilisation at which the SLO still holds;
it becomes a capacity bound in the LP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = [
    "SEED_BREAKPOINTS_RHO",
    "LatencyProfile",
    "segment_slopes",
]

FloatArray = npt.NDArray[np.float64]

#: Utilisation grid of the reference benchmarks (K = 8 segments, ρ_max = 0.95).
SEED_BREAKPOINTS_RHO: tuple[float, ...] = (0.0, 0.30, 0.50, 0.65, 0.75, 0.83, 0.89, 0.93, 0.95)


def segment_slopes(breakpoints_rho: npt.ArrayLike, latency_s: npt.ArrayLike) -> FloatArray:
    """Convexified segment slopes of ``φ(ρ) = ρ · L(ρ)``.

    Parameters
    ----------
    breakpoints_rho : array_like, shape (K + 1,)
        Strictly increasing utilisation grid starting at 0.
    latency_s : array_like, shape (K + 1,)
        Per-request latency ``L(b_k)`` in seconds at each breakpoint.

    Returns
    -------
    ndarray, shape (K,)
        ``m_k = Δ(b · L) / Δb`` made non-decreasing with a running maximum, in seconds.
    """
    b = np.asarray(breakpoints_rho, dtype=np.float64)
    lat = np.asarray(latency_s, dtype=np.float64)
    if b.ndim != 1 or b.shape != lat.shape or b.size < 2:
        raise ValueError(
            "breakpoints and latencies must be 1-D of equal length >= 2, "
            f"got {b.shape}, {lat.shape}"
        )
    raw = np.diff(b * lat) / np.diff(b)
    return np.maximum.accumulate(raw)


def _check_grid(b: FloatArray) -> None:
    if b.ndim != 1 or b.size < 2:
        raise ValueError(f"need at least two breakpoints, got shape {b.shape}")
    if b[0] != 0.0 or not np.all(np.diff(b) > 0) or b[-1] > 1.0:
        raise ValueError(
            f"breakpoints must increase strictly from 0 to at most 1, got {b.tolist()}"
        )


@dataclass(frozen=True, eq=False)
class LatencyProfile:
    """Latency vs utilisation of one engine shape, and its convex PWL cost.

    Parameters
    ----------
    breakpoints_rho : ndarray, shape (K + 1,)
        Utilisation grid ``0 = b_0 < … < b_K = ρ_max ≤ 1``.
    ttft_s : ndarray, shape (K + 1,)
        Time to first token (s) at each breakpoint.
    tbot_s : ndarray, shape (K + 1,)
        Time between output tokens (s) at each breakpoint.
    mean_output_tokens : float
        ``E[N_out]``, the expected output length of a request.
    gamma : float
        Weight of decode time against TTFT in ``L``; 1 counts end-to-end latency.

    Attributes
    ----------
    latency_s : ndarray, shape (K + 1,)
        ``L(b_k) = TTFT + γ · E[N_out] · TBOT`` (s).
    slopes_s : ndarray, shape (K,)
        Non-decreasing segment slopes ``m_k`` (s per unit of rate).
    widths_rho : ndarray, shape (K,)
        ``b_k − b_{k−1}``; an engine's segment widths are ``widths_rho · C · h``.
    """

    breakpoints_rho: FloatArray
    ttft_s: FloatArray
    tbot_s: FloatArray
    mean_output_tokens: float = 300.0
    gamma: float = 1.0
    latency_s: FloatArray = field(init=False, repr=False)
    slopes_s: FloatArray = field(init=False, repr=False)
    widths_rho: FloatArray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        b = np.array(self.breakpoints_rho, dtype=np.float64)
        ttft = np.array(self.ttft_s, dtype=np.float64)
        tbot = np.array(self.tbot_s, dtype=np.float64)
        _check_grid(b)
        if ttft.shape != b.shape or tbot.shape != b.shape:
            raise ValueError(
                f"ttft_s {ttft.shape} and tbot_s {tbot.shape} must match breakpoints {b.shape}"
            )
        if not (np.all(np.isfinite(ttft)) and np.all(np.isfinite(tbot))):
            raise ValueError("ttft_s and tbot_s must be finite")
        if np.any(ttft < 0) or np.any(tbot < 0):
            raise ValueError("ttft_s and tbot_s must be >= 0")
        if not (self.mean_output_tokens >= 0 and self.gamma >= 0):
            raise ValueError("mean_output_tokens and gamma must be >= 0")
        lat = ttft + self.gamma * self.mean_output_tokens * tbot
        for name, arr in (
            ("breakpoints_rho", b),
            ("ttft_s", ttft),
            ("tbot_s", tbot),
            ("latency_s", lat),
            ("slopes_s", segment_slopes(b, lat)),
            ("widths_rho", np.diff(b)),
        ):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def seed(
        cls,
        ttft0_s: float,
        tbot0_s: float,
        *,
        mean_output_tokens: float = 300.0,
        gamma: float = 1.0,
        tbot_load_factor: float = 0.8,
        breakpoints_rho: npt.ArrayLike = SEED_BREAKPOINTS_RHO,
    ) -> LatencyProfile:
        """The parametric M/M/1-like profile used before measurements exist.

        ``TTFT(ρ) = ttft0 / (1 − ρ)`` and ``TBOT(ρ) = tbot0 · (1 + tbot_load_factor · ρ)``; with
        the defaults ``L(ρ) = ttft0/(1−ρ) + 300 · tbot0 · (1 + 0.8ρ)`` (reference §1.2).

        Parameters
        ----------
        ttft0_s, tbot0_s : float
            Idle TTFT and TBOT (s).
        mean_output_tokens, gamma : float
            See the class parameters.
        tbot_load_factor : float
            Relative TBOT increase from idle to full utilisation.
        breakpoints_rho : array_like
            The grid; its last value must be < 1.
        """
        b = np.asarray(breakpoints_rho, dtype=np.float64)
        if b.size and b[-1] >= 1.0:
            raise ValueError("the seed profile needs rho_max < 1 (TTFT diverges at rho = 1)")
        return cls(
            b,
            ttft0_s / (1.0 - b),
            tbot0_s * (1.0 + tbot_load_factor * b),
            mean_output_tokens=mean_output_tokens,
            gamma=gamma,
        )

    @classmethod
    def from_samples(
        cls,
        rho: npt.ArrayLike,
        ttft_s: npt.ArrayLike,
        tbot_s: npt.ArrayLike,
        *,
        seed: LatencyProfile,
        min_samples: int = 5,
    ) -> LatencyProfile:
        """Fit a profile to measured ``(ρ, TTFT, TBOT)`` samples on the seed's grid.

        Samples are binned around each breakpoint (bin edges at the midpoints between breakpoints;
        samples above ``ρ_max`` go to the last bin). In a bin with at least ``min_samples``
        samples the profile is the seed value at the breakpoint times the ratio of the binned
        means ``mean(observed) / mean(seed(ρ_i))``, which corrects for where in the bin the samples
        fell; a thinner bin keeps the seed value. TTFT and TBOT are then made non-decreasing in ρ
        (running maximum) and the slopes convexified as for every profile.

        Parameters
        ----------
        rho : array_like, shape (n,)
            Measured utilisation of each sample (load / effective capacity).
        ttft_s, tbot_s : array_like, shape (n,)
            Measured mean TTFT and TBOT (s) in the sample's window.
        seed : LatencyProfile
            Prior shape, grid, ``E[N_out]`` and ``γ``.
        min_samples : int
            Fewest samples for a bin to override the seed.

        Returns
        -------
        LatencyProfile
        """
        r = np.asarray(rho, dtype=np.float64)
        obs_ttft = np.asarray(ttft_s, dtype=np.float64)
        obs_tbot = np.asarray(tbot_s, dtype=np.float64)
        if not (r.shape == obs_ttft.shape == obs_tbot.shape) or r.ndim != 1:
            raise ValueError("rho, ttft_s and tbot_s must be 1-D arrays of equal length")
        ok = np.isfinite(r) & np.isfinite(obs_ttft) & np.isfinite(obs_tbot) & (r >= 0)
        r, obs_ttft, obs_tbot = r[ok], obs_ttft[ok], obs_tbot[ok]
        b = seed.breakpoints_rho
        n_bins = b.size
        bins = np.searchsorted((b[:-1] + b[1:]) / 2.0, r, side="right")  # 0..K
        # seed values at each sample's own utilisation (linear between breakpoints)
        seed_ttft = np.interp(r, b, seed.ttft_s)
        seed_tbot = np.interp(r, b, seed.tbot_s)
        count = np.bincount(bins, minlength=n_bins)
        ttft = seed.ttft_s.copy()
        tbot = seed.tbot_s.copy()
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio_ttft = np.bincount(bins, obs_ttft, n_bins) / np.bincount(bins, seed_ttft, n_bins)
            ratio_tbot = np.bincount(bins, obs_tbot, n_bins) / np.bincount(bins, seed_tbot, n_bins)
        dense = count >= max(1, min_samples)
        use_ttft = dense & np.isfinite(ratio_ttft)
        use_tbot = dense & np.isfinite(ratio_tbot)
        ttft[use_ttft] *= ratio_ttft[use_ttft]
        tbot[use_tbot] *= ratio_tbot[use_tbot]
        return cls(
            b,
            np.maximum.accumulate(ttft),
            np.maximum.accumulate(tbot),
            mean_output_tokens=seed.mean_output_tokens,
            gamma=seed.gamma,
        )

    # -- derived quantities -------------------------------------------------------------------

    @property
    def n_segments(self) -> int:
        """K, the number of PWL segments."""
        return int(self.slopes_s.size)

    @property
    def rho_max(self) -> float:
        """Largest admissible utilisation ``b_K``."""
        return float(self.breakpoints_rho[-1])

    def shape_key(self, decimals: int = 9) -> tuple[float, ...]:
        """Hashable identity of the cost shape (grid + slopes), for exact aggregation."""
        return tuple(np.round(np.concatenate([self.breakpoints_rho, self.slopes_s]), decimals))

    def cost_per_capacity(self, rho: npt.ArrayLike) -> FloatArray:
        """The convexified ``φ̃(ρ) = Σ_k m_k · clip(ρ − b_{k−1}, 0, b_k − b_{k−1})``.

        ``C · φ̃(λ/C)`` is the latency rate (s·req/s) the LP charges an engine of effective
        capacity ``C`` at load ``λ``; beyond ``ρ_max`` the value is capped (the LP forbids it).
        """
        r = np.asarray(rho, dtype=np.float64)[..., None]
        fill = np.clip(r - self.breakpoints_rho[:-1], 0.0, self.widths_rho)
        return np.asarray(fill @ self.slopes_s, dtype=np.float64)

    def marginal_latency_s(self, rho: float) -> float:
        """Slope of the segment containing ``ρ`` (the right derivative at a breakpoint)."""
        k = int(np.searchsorted(self.breakpoints_rho, rho, side="right")) - 1
        return float(self.slopes_s[min(max(k, 0), self.n_segments - 1)])
