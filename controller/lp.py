"""The routing LP in deviation form: problem data and the vectorised CSC build.

Formulation (docs/controller.md, docs/algorithms.md §1.3–1.5). Classes ``g`` (rows of
``demand_rps``), engines or engine groups ``e``, eligible pairs ``A`` (``eligible[g, e]``), ``K``
PWL segments per engine. The routed rate is ``x_ge = x⁰_ge + p_ge − q_ge`` with the previous
solution ``x⁰`` as anchor::

    min   Σ_A (d_ge + κ_ge) p_ge + (κ_ge − d_ge) q_ge  +  Σ_e Σ_k m_ek s_ek  +  Σ_g P_g shed_g
          (+ constant Σ_A d_ge x⁰_ge, passed to HiGHS as the objective offset)
    s.t.  demand g:  Σ_e (p_ge − q_ge) + shed_g   = D_g − Σ_e x⁰_ge
          link   e:  Σ_g (p_ge − q_ge) − Σ_k s_ek =   − Σ_g x⁰_ge          (load_e = Σ_k s_ek)
          0 ≤ p,  0 ≤ q ≤ x⁰,  0 ≤ s_ek ≤ W_ek = (b_k − b_{k−1}) C_e h_e,  0 ≤ shed_g ≤ D_g

A class aggregated over priorities (:mod:`controller.class_groups`) has several shed columns
instead of one, ``shed_j ≤ D_j`` at ``π_j P₀`` each (``shed_segment_*``); ``shed_g`` above is then
their sum, and ``n_G`` below in the column counts becomes the number of shed columns.

Columns are ordered ``[p (n_A), q (n_A), s (n_E·K), shed (n_G)]``, rows ``[demand (n_G), link
(n_E)]``; ``2·n_A + n_E·K + n_G`` columns, ``n_G + n_E`` rows, ``4·n_A + n_E·K + n_G`` nonzeros.
Every p/q column has exactly two nonzeros, so the CSC arrays are built with ``np.repeat`` /
``np.concatenate`` and no Python loop over nonzeros. The matrix depends only on the *structure*
(``A``, ``n_E``, ``K``); demands, latencies, κ, capacities, health and the anchor change only the
cost, bound and right-hand-side vectors (:func:`lp_vectors`), which is what the warm start updates.

Units: rates in the demand's unit (req/s or work units/s, ``_rps``); latencies, slopes, κ and
penalties in seconds (per unit of rate), so the objective is a latency rate (s·req/s).

Tunables: ``kappa_s`` (L1 move penalty; physical value ``t_miss / (r_s · H)``, ×2 for HRW);
``shed_weight`` ``π_g`` (1 / 10 / 100 for batch / default / interactive) and
``shed_penalty_base_s`` ``P₀`` (default ``10 · (max m + max d + 2 max κ)`` ≥ ``10 · max m``), so
``P_g = π_g P₀`` sheds only when demand cannot be served, lowest priority first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from controller.groups import EngineGroups
from controller.latency import LatencyProfile

__all__ = [
    "PRIORITY_SHED_WEIGHT",
    "LPArrays",
    "LPVectors",
    "RoutingProblem",
    "build_lp",
    "lp_vectors",
]

FloatArray = npt.NDArray[np.float64]
Int32Array = npt.NDArray[np.int32]

#: Shed penalty multipliers π by priority name.
PRIORITY_SHED_WEIGHT: dict[str, float] = {"batch": 1.0, "default": 10.0, "interactive": 100.0}


def _profile_matrices(
    profiles: Sequence[LatencyProfile],
) -> tuple[FloatArray, FloatArray]:
    """Stack slopes and widths; shorter grids get zero-width copies of their last slope."""
    k_max = max(p.n_segments for p in profiles)
    slopes = np.empty((len(profiles), k_max))
    widths = np.zeros((len(profiles), k_max))
    for i, p in enumerate(profiles):
        k = p.n_segments
        slopes[i, :k] = p.slopes_s
        slopes[i, k:] = p.slopes_s[-1]
        widths[i, :k] = p.widths_rho
    return slopes, widths


@dataclass(frozen=True, eq=False)
class RoutingProblem:
    """Data of one routing LP (classes × engines or engine groups).

    Parameters
    ----------
    demand_rps : ndarray, shape (n_classes,)
        Forecast demand ``D_g`` (≥ 0).
    eligible : ndarray of bool, shape (n_classes, n_engines)
        Eligible pairs ``A``; only these get columns.
    network_latency_s : ndarray, shape (n_classes, n_engines)
        ``d_ge`` (s): RTT + proxy overhead (+ KV transfer for P/D); ignored where not eligible.
    capacity_rps : ndarray, shape (n_engines,)
        Effective capacity ``C_e · h_e`` (rate at ρ = 1); 0 forces the engine's load to 0.
    slopes_s : ndarray, shape (n_engines, K)
        Non-decreasing segment slopes ``m_ek`` (s).
    widths_rho : ndarray, shape (n_engines, K)
        ``b_k − b_{k−1}``; segment widths are ``widths_rho · capacity_rps``.
    shed_weight : ndarray, shape (n_classes,)
        Priority multipliers ``π_g`` (see :data:`PRIORITY_SHED_WEIGHT`).
    kappa_s : float or ndarray, shape (n_classes, n_engines)
        L1 move penalty ``κ_ge`` (s per unit of moved rate), ≥ 0.
    shed_penalty_base_s : float, optional
        ``P₀``; default ``10 · (max m + max d + 2 max κ)``.
    allow_shed : bool
        ``False`` fixes every shed variable at 0 (the LP is then infeasible above capacity).
    shed_segment_class, shed_segment_weight, shed_segment_rps : ndarray, shape (n_shed,), optional
        Several shed columns per class (a class aggregated over priorities,
        :mod:`controller.class_groups`): column ``j`` sheds up to ``shed_segment_rps[j]`` of class
        ``shed_segment_class[j]`` at ``shed_segment_weight[j] · P₀``. Default (all None): one
        column per class, ``π_g`` up to ``D_g``; ``shed_weight`` is then ignored.
    """

    demand_rps: FloatArray
    eligible: npt.NDArray[np.bool_]
    network_latency_s: FloatArray
    capacity_rps: FloatArray
    slopes_s: FloatArray
    widths_rho: FloatArray
    shed_weight: FloatArray
    kappa_s: float | FloatArray = 0.0
    shed_penalty_base_s: float | None = None
    allow_shed: bool = True
    shed_segment_class: npt.NDArray[np.intp] | None = None
    shed_segment_weight: FloatArray | None = None
    shed_segment_rps: FloatArray | None = None
    kappa_matrix_s: FloatArray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        conv = {
            "demand_rps": np.asarray(self.demand_rps, dtype=np.float64),
            "eligible": np.asarray(self.eligible, dtype=bool),
            "network_latency_s": np.asarray(self.network_latency_s, dtype=np.float64),
            "capacity_rps": np.asarray(self.capacity_rps, dtype=np.float64),
            "slopes_s": np.asarray(self.slopes_s, dtype=np.float64),
            "widths_rho": np.asarray(self.widths_rho, dtype=np.float64),
            "shed_weight": np.asarray(self.shed_weight, dtype=np.float64),
        }
        for name, arr in conv.items():
            object.__setattr__(self, name, arr)
        n_g, n_e = conv["eligible"].shape if conv["eligible"].ndim == 2 else (-1, -1)
        expect = {
            "demand_rps": (n_g,),
            "network_latency_s": (n_g, n_e),
            "capacity_rps": (n_e,),
            "shed_weight": (n_g,),
        }
        for name, shape in expect.items():
            if conv[name].shape != shape:
                raise ValueError(f"{name} has shape {conv[name].shape}, expected {shape}")
        if conv["slopes_s"].ndim != 2 or conv["slopes_s"].shape[0] != n_e:
            raise ValueError(f"slopes_s must be (n_engines={n_e}, K), got {conv['slopes_s'].shape}")
        if conv["widths_rho"].shape != conv["slopes_s"].shape:
            raise ValueError("widths_rho must have the shape of slopes_s")
        kappa = np.broadcast_to(np.asarray(self.kappa_s, dtype=np.float64), (n_g, n_e))
        object.__setattr__(self, "kappa_matrix_s", kappa)
        elig = conv["eligible"]
        checks = {
            "demand_rps": conv["demand_rps"],
            "capacity_rps": conv["capacity_rps"],
            "slopes_s": conv["slopes_s"],
            "widths_rho": conv["widths_rho"],
            "shed_weight": conv["shed_weight"],
            "network_latency_s (eligible pairs)": conv["network_latency_s"][elig],
            "kappa_s (eligible pairs)": kappa[elig],
        }
        for name, arr in checks.items():
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise ValueError(f"{name} must be finite and >= 0")
        if np.any(np.diff(conv["slopes_s"], axis=1) < 0):
            raise ValueError("slopes_s must be non-decreasing along segments (convexify first)")
        if self.shed_penalty_base_s is not None and not self.shed_penalty_base_s > 0:
            raise ValueError("shed_penalty_base_s must be > 0")
        self._check_shed_segments(n_g)

    def _check_shed_segments(self, n_g: int) -> None:
        seg = (self.shed_segment_class, self.shed_segment_weight, self.shed_segment_rps)
        if all(v is None for v in seg):
            return
        if any(v is None for v in seg):
            raise ValueError("shed_segment_class, _weight and _rps must be given together")
        cls_ = np.asarray(self.shed_segment_class, dtype=np.intp)
        weight = np.asarray(self.shed_segment_weight, dtype=np.float64)
        rps = np.asarray(self.shed_segment_rps, dtype=np.float64)
        if cls_.ndim != 1 or weight.shape != cls_.shape or rps.shape != cls_.shape:
            raise ValueError("shed segments must be three 1-D arrays of one length")
        if cls_.size and (cls_.min() < 0 or cls_.max() >= n_g):
            raise ValueError(f"shed_segment_class must index the {n_g} classes")
        both = np.concatenate([weight, rps])
        if not np.all(np.isfinite(both)) or np.any(both < 0):
            raise ValueError("shed segment weights and rates must be finite and >= 0")
        object.__setattr__(self, "shed_segment_class", cls_)
        object.__setattr__(self, "shed_segment_weight", weight)
        object.__setattr__(self, "shed_segment_rps", rps)

    @classmethod
    def from_profiles(
        cls,
        demand_rps: npt.ArrayLike,
        profiles: Sequence[LatencyProfile],
        capacity_rps: npt.ArrayLike,
        eligible: npt.ArrayLike,
        network_latency_s: npt.ArrayLike,
        *,
        health: npt.ArrayLike | None = None,
        shed_weight: npt.ArrayLike | None = None,
        kappa_s: float | npt.ArrayLike = 0.0,
        shed_penalty_base_s: float | None = None,
        allow_shed: bool = True,
    ) -> RoutingProblem:
        """An ungrouped problem: one LP engine per engine, capacity ``cap · h``.

        ``shed_weight`` defaults to the "default" priority (10) for every class.
        """
        cap = np.asarray(capacity_rps, dtype=np.float64)
        h = np.ones_like(cap) if health is None else np.asarray(health, dtype=np.float64)
        slopes, widths = _profile_matrices(profiles)
        d = np.asarray(demand_rps, dtype=np.float64)
        pi = (
            np.full(d.shape, PRIORITY_SHED_WEIGHT["default"])
            if shed_weight is None
            else np.asarray(shed_weight, dtype=np.float64)
        )
        return cls(
            demand_rps=d,
            eligible=np.asarray(eligible, dtype=bool),
            network_latency_s=np.asarray(network_latency_s, dtype=np.float64),
            capacity_rps=cap * h,
            slopes_s=slopes,
            widths_rho=widths,
            shed_weight=pi,
            kappa_s=np.asarray(kappa_s, dtype=np.float64),
            shed_penalty_base_s=shed_penalty_base_s,
            allow_shed=allow_shed,
        )

    @classmethod
    def from_groups(
        cls,
        demand_rps: npt.ArrayLike,
        groups: EngineGroups,
        *,
        shed_weight: npt.ArrayLike | None = None,
        kappa_s: float | npt.ArrayLike = 0.0,
        shed_penalty_base_s: float | None = None,
        allow_shed: bool = True,
    ) -> RoutingProblem:
        """A grouped problem (exact aggregation): one LP engine per :class:`EngineGroups` group.

        ``kappa_s`` may be a scalar or ``(n_classes, n_groups)``.
        """
        return cls.from_profiles(
            demand_rps,
            groups.profiles,
            groups.capacity_rps,
            groups.eligible,
            groups.network_latency_s,
            shed_weight=shed_weight,
            kappa_s=kappa_s,
            shed_penalty_base_s=shed_penalty_base_s,
            allow_shed=allow_shed,
        )

    @property
    def n_classes(self) -> int:
        """``n_G``."""
        return int(self.demand_rps.size)

    @property
    def n_engines(self) -> int:
        """``n_E`` (engines or groups)."""
        return int(self.capacity_rps.size)

    @property
    def n_segments(self) -> int:
        """``K``."""
        return int(self.slopes_s.shape[1])

    def shed_penalty_base(self) -> float:
        """``P₀`` (s per unit of shed rate): ``shed_penalty_base_s`` or its default."""
        if self.shed_penalty_base_s is not None:
            return float(self.shed_penalty_base_s)
        elig = self.eligible
        max_m = float(self.slopes_s.max(initial=0.0))
        max_d = float(self.network_latency_s[elig].max(initial=0.0))
        max_k = float(self.kappa_matrix_s[elig].max(initial=0.0))
        return 10.0 * max(max_m + max_d + 2.0 * max_k, 1e-3)

    def shed_penalty_s(self) -> FloatArray:
        """``P_g = π_g · P₀`` (s per unit of shed rate)."""
        return self.shed_weight * self.shed_penalty_base()

    def shed_columns(self) -> tuple[npt.NDArray[np.int32], FloatArray, FloatArray]:
        """The shed columns: class of each, cost (s per unit), upper bound (rate).

        One per class (``P_g``, ``D_g``) unless shed segments are given; upper bounds are 0
        without ``allow_shed``.
        """
        if self.shed_segment_class is None:
            cls_ = np.arange(self.n_classes, dtype=np.int32)
            cost, upper = self.shed_penalty_s(), self.demand_rps
        else:
            assert self.shed_segment_weight is not None and self.shed_segment_rps is not None
            cls_ = self.shed_segment_class.astype(np.int32)
            cost = self.shed_segment_weight * self.shed_penalty_base()
            upper = self.shed_segment_rps
        return cls_, cost, upper if self.allow_shed else np.zeros(cls_.size)


@dataclass(frozen=True, eq=False)
class LPVectors:
    """The data-dependent part of the LP (what a warm re-solve updates)."""

    cost: FloatArray
    upper: FloatArray
    rhs: FloatArray
    offset: float
    x_prev_pairs: FloatArray


@dataclass(frozen=True, eq=False)
class LPArrays:
    """A complete LP in HiGHS column-wise form plus its pair index.

    Attributes
    ----------
    class_index, engine_index : ndarray of int32, shape (n_A,)
        The eligible pairs, row-major over ``(class, engine)``.
    a_start, a_index, a_value : ndarray
        CSC matrix (``a_start`` has ``n_col + 1`` entries).
    vectors : LPVectors
        Costs, column upper bounds (lower bounds are all 0), row rhs (equality rows), offset.
    """

    n_classes: int
    n_engines: int
    n_segments: int
    class_index: Int32Array
    engine_index: Int32Array
    a_start: Int32Array
    a_index: Int32Array
    a_value: FloatArray
    vectors: LPVectors
    shed_class: npt.NDArray[np.int32] | None = None

    @property
    def n_shed(self) -> int:
        """Shed columns (``n_G`` unless the problem has shed segments)."""
        return self.n_classes if self.shed_class is None else int(self.shed_class.size)

    @property
    def n_pairs(self) -> int:
        """``n_A``."""
        return int(self.class_index.size)

    @property
    def n_cols(self) -> int:
        """``2 n_A + n_E K + n_shed`` (``n_shed = n_G`` without shed segments)."""
        return 2 * self.n_pairs + self.n_engines * self.n_segments + self.n_shed

    @property
    def n_rows(self) -> int:
        """``n_G + n_E``."""
        return self.n_classes + self.n_engines


def _anchor_pairs(
    problem: RoutingProblem, g: Int32Array, e: Int32Array, x_prev_rps: npt.ArrayLike | None
) -> FloatArray:
    if x_prev_rps is None:
        return np.zeros(g.size)
    x0 = np.asarray(x_prev_rps, dtype=np.float64)
    if x0.shape != problem.eligible.shape:
        raise ValueError(f"x_prev_rps has shape {x0.shape}, expected {problem.eligible.shape}")
    pairs = x0[g, e]
    if not np.all(np.isfinite(pairs)) or np.any(pairs < 0):
        raise ValueError("x_prev_rps must be finite and >= 0 on eligible pairs")
    return pairs


def lp_vectors(
    problem: RoutingProblem,
    class_index: Int32Array,
    engine_index: Int32Array,
    x_prev_rps: npt.ArrayLike | None = None,
) -> LPVectors:
    """Costs, upper bounds, rhs and objective offset for ``problem`` anchored at ``x_prev_rps``.

    Anchor entries outside the eligible pairs are dropped (that traffic must move anyway).
    """
    g, e = class_index, engine_index
    n_g, n_e = problem.n_classes, problem.n_engines
    x0 = _anchor_pairs(problem, g, e, x_prev_rps)
    d = problem.network_latency_s[g, e]
    kappa = problem.kappa_matrix_s[g, e]
    width = problem.widths_rho * problem.capacity_rps[:, None]
    _, shed_cost, shed_upper = problem.shed_columns()
    cost = np.concatenate([d + kappa, kappa - d, problem.slopes_s.ravel(), shed_cost])
    upper = np.concatenate([np.full(g.size, np.inf), x0, width.ravel(), shed_upper])
    rhs = np.concatenate([problem.demand_rps - np.bincount(g, x0, n_g), -np.bincount(e, x0, n_e)])
    return LPVectors(cost=cost, upper=upper, rhs=rhs, offset=float(d @ x0), x_prev_pairs=x0)


def build_lp(problem: RoutingProblem, x_prev_rps: npt.ArrayLike | None = None) -> LPArrays:
    """Build the full LP (matrix + vectors) without a Python loop over nonzeros.

    Parameters
    ----------
    problem : RoutingProblem
    x_prev_rps : array_like, shape (n_classes, n_engines), optional
        The anchor ``x⁰`` (previous published solution); default zeros (a cold start).

    Returns
    -------
    LPArrays
    """
    n_g, n_e, k = problem.n_classes, problem.n_engines, problem.n_segments
    gi, ei = np.nonzero(problem.eligible)
    g = gi.astype(np.int32)
    e = ei.astype(np.int32)
    n_a = g.size
    shed_class = problem.shed_columns()[0]
    n_s = shed_class.size
    idx_pq = np.empty(2 * n_a, dtype=np.int32)
    idx_pq[0::2] = g
    idx_pq[1::2] = n_g + e
    a_index = np.concatenate(
        [
            idx_pq,
            idx_pq,
            np.repeat(n_g + np.arange(n_e, dtype=np.int32), k),
            shed_class,
        ]
    )
    a_value = np.concatenate([np.ones(2 * n_a), -np.ones(2 * n_a), -np.ones(n_e * k), np.ones(n_s)])
    nnz_col = np.concatenate(
        [np.full(2 * n_a, 2, dtype=np.int32), np.ones(n_e * k + n_s, dtype=np.int32)]
    )
    a_start = np.zeros(nnz_col.size + 1, dtype=np.int32)
    np.cumsum(nnz_col, out=a_start[1:])
    return LPArrays(
        n_classes=n_g,
        n_engines=n_e,
        n_segments=k,
        class_index=g,
        engine_index=e,
        a_start=a_start,
        a_index=a_index,
        a_value=a_value,
        vectors=lp_vectors(problem, g, e, x_prev_rps),
        shed_class=None if problem.shed_segment_class is None else shed_class,
    )
