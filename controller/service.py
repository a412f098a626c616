"""The control loop: demand → LP → weights → shared-memory table (+ HTTP snapshot).

Every ``controller.period_s`` :meth:`ControllerService.step` does, in order:

1. **Demand**: :class:`controller.demand.DemandForecaster` closes the period (EWMA + recent peak of
   the proxies' reported requests/s per class, held within a dead band of 2 Poisson standard
   errors so the LP does not re-split traffic on sampling noise). A class never measured gets the
   default: each engine's capacity split equally over the classes eligible on it, times
   ``default_fraction`` (0.5), so the defaults of all classes together ask for half the fleet.
   Floor: ``floor_fraction`` (1e-3) of the class's eligible capacity, so no row empties while
   engines exist.
2. **LP data** (static, built once from the config, :class:`FleetModel`): classes are
   (source cluster, model, priority) for every declared region, served model and priority, keyed
   by :func:`class_key` (the proxy's row key), for every model some ``both`` engine serves (a P/D
   model has no rows: the proxy weighs its pools by capacity and the controller never sheds
   it). Eligibility: the engine serves the model and has role ``both``; every zone is eligible
   (the proxy filters zones per request). Network latency: the config RTT from the class's
   cluster to the engine's region (one round trip per request).
   Profiles: seeded with :meth:`LatencyProfile.seed` and the per-hardware constants of
   :data:`HARDWARE_SEED_LATENCY_S` on the config's breakpoint grid, then fitted online per *fit
   group* (hardware, models, region, role) by :class:`controller.profiles.ProfileFitter` from
   every window's signals; a refit replaces a group's profile only past ``profile_deadband``.
   Health from the derating state (see below). Engines are grouped
   (:func:`controller.groups.group_engines`, exact aggregation) again whenever health or a
   profile changes.
3. **Solve** :class:`controller.solve.RoutingLP` (warm; the anchor ``x⁰`` is what the published
   table sends at the new forecast, :func:`controller.weights.table_anchor`) in a worker thread
   (``asyncio.to_thread``), HiGHS time limit
   ``controller.solve_time_limit_s``. Shed penalty base ``P₀ = shed_base_factor · (max m + max d +
   2 max κ)`` (never cheaper to shed than to serve anything servable), ``π`` per priority from
   ``controller.shed_penalties``. A period whose LP inputs equal the last successful solve's
   reuses its result (:class:`controller.memo.SolveMemo`): no hand-off, no HiGHS run.
4. **Weights**: :func:`class_weights` (fallback: eligible capacity for classes without
   allocation), :func:`engine_weights` (split ∝ capacity), :func:`validate_weights`. Shed
   fractions from :func:`shed_at_demand` at the *live* forecast (the LP planned for the held one).
5. **Publish**, only when weights, shed fractions or the retry ratio changed, to the local table
   ``TableWriter(table_name)`` with ``meta`` = plan id, status, objective, solve time, and the retry
   ratio ``retry.ratio`` (× ``shed_retry_factor`` = 0.2 while any class is shed); the same
   generation is kept as a wire snapshot for ``GET /v1/table``.

On :class:`SolveError`, invalid weights or a table error the last good table stays published, the
alert counter ``fastroute_controller_alerts_total{kind}`` increments and the error is logged (once
per distinct message in a row).

**Derating** (:mod:`controller.health`): the proxies' per-engine report entries are summed per
period; at the start of each period :class:`controller.health.HealthTracker` scores the window
(residual vs profile, robust z within the peer group, error rate) and steps health levels
``h ∈ {0, .25, .5, .75, 1}`` with hysteresis. A change regroups nothing (only ``C · h`` changes,
the engine keeps its group); level 0 publishes ``FLAG_UNAVAILABLE`` for the engine. Not done here:
P/D pairs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.baseline import BaselinePolicy, window_latency_s
from controller.calibration import CalibrationBoard
from controller.demand import DemandForecaster
from controller.groups import EngineGroups, group_engines, regroup_rates
from controller.health import (
    MAD_TO_SIGMA,
    HealthTracker,
    HealthWindow,
    LevelChange,
    SignalAccumulator,
    peer_groups,
)
from controller.latency import LatencyProfile
from controller.lp import RoutingProblem
from controller.memo import SolveInputs, SolveMemo
from controller.profiles import ProfileFitter
from controller.scrape import EngineScraper, ScrapeWindow
from controller.sifting import SiftingLP
from controller.solve import RoutingLP, SolveError, SolveResult
from controller.weights import (
    class_weights,
    engine_weights,
    shed_at_demand,
    table_anchor,
    validate_weights,
)
from fastroute.config import PRIORITIES, Config
from fastroute.errors import TableError
from fastroute.hashing import class_key, engine_id
from fastroute.signals.reports import Report
from fastroute.tables import FLAG_UNAVAILABLE, TableSnapshot, TableWriter

__all__ = [
    "HARDWARE_SEED_LATENCY_S",
    "MODES",
    "ClassSpec",
    "ControllerMetrics",
    "ControllerService",
    "FleetModel",
    "Plan",
    "ReloadOutcome",
    "carry_forecast",
    "class_key",
]

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

#: Idle (TTFT₀, TBOT₀) in seconds per hardware class, for the seed profiles
#: ``TTFT(ρ) = TTFT₀/(1−ρ)``, ``TBOT(ρ) = TBOT₀(1 + 0.8ρ)``. Rough figures for an 8B model at the
#: typical request mix (ordering by memory bandwidth, H100 fastest); only ratios between hardware
#: and the shape matter to the LP until profiles are fitted from signals.
HARDWARE_SEED_LATENCY_S: dict[str, tuple[float, float]] = {
    "h100": (0.05, 0.008),
    "a100": (0.08, 0.012),
    "a40": (0.15, 0.025),
    "l4": (0.25, 0.045),
}
#: Grouped LPs with at least this many eligible (class, group) pairs are solved by column
#: generation (:class:`controller.sifting.SiftingLP`).
SIFTING_MIN_PAIRS = 10_000
#: Control policies: the LP (default) and the legacy proportional controller (baseline).
MODES: tuple[str, ...] = ("lp", "p-controller")
#: Seed constants for hardware classes not in :data:`HARDWARE_SEED_LATENCY_S`.
FALLBACK_SEED_LATENCY_S: tuple[float, float] = HARDWARE_SEED_LATENCY_S["a40"]


@dataclass(frozen=True)
class ClassSpec:
    """One demand class (a table row).

    Attributes
    ----------
    key : int
        :func:`class_key` of the class.
    cluster, model, priority : str
        Source cluster (region), served model, priority.
    """

    key: int
    cluster: str
    model: str
    priority: str

    @property
    def name(self) -> str:
        """``cluster/model/priority`` (metrics label, plan key)."""
        return f"{self.cluster}/{self.model}/{self.priority}"


@dataclass(frozen=True, eq=False)
class FleetModel:
    """The static LP data derived from the config.

    Attributes
    ----------
    classes : tuple of ClassSpec
        Rows, ordered by cluster (config order), model (sorted), priority (lowest first).
    engine_names : tuple of str
        Columns, config order.
    engine_ids : ndarray of uint64, shape (n_engines,)
    capacity_rps : ndarray, shape (n_engines,)
        Nominal capacity from the config.
    eligible : ndarray of bool, shape (n_classes, n_engines)
    network_latency_s : ndarray, shape (n_classes, n_engines)
        RTT class cluster → engine region (s).
    profiles : tuple of LatencyProfile
        Seed profile per engine (one shared object per hardware class).
    groups : EngineGroups
        Exact aggregation of the engines.
    shed_weight : ndarray, shape (n_classes,)
        π per class from ``controller.shed_penalties``.
    default_rps, floor_rps : ndarray, shape (n_classes,)
        Demand before any measurement, and the demand floor.
    """

    classes: tuple[ClassSpec, ...]
    engine_names: tuple[str, ...]
    engine_ids: npt.NDArray[np.uint64]
    capacity_rps: FloatArray
    eligible: npt.NDArray[np.bool_]
    network_latency_s: FloatArray
    profiles: tuple[LatencyProfile, ...]
    groups: EngineGroups
    shed_weight: FloatArray
    default_rps: FloatArray
    floor_rps: FloatArray

    @classmethod
    def from_config(
        cls, config: Config, *, default_fraction: float = 0.5, floor_fraction: float = 1e-3
    ) -> FleetModel:
        """Build classes, eligibility, RTTs, seed profiles and groups from ``config``."""
        ctl = config.controller
        grid = (0.0, *ctl.breakpoints)
        by_hw: dict[str, LatencyProfile] = {}
        for hw in sorted({e.hardware for e in config.engines}):
            ttft0, tbot0 = HARDWARE_SEED_LATENCY_S.get(hw.lower(), FALLBACK_SEED_LATENCY_S)
            by_hw[hw] = LatencyProfile.seed(ttft0, tbot0, breakpoints_rho=grid)
        engines = config.engines
        # P/D models (served by prefill and decode engines only) get no rows: the proxy
        # routes their pools by capacity (fastroute/proxy/pd.py). A row without an
        # eligible engine would be shed in full.
        lp_models = [
            m for m in config.models() if any(m in e.models for e in engines if e.role == "both")
        ]
        classes = tuple(
            ClassSpec(class_key(r.name, m, p), r.name, m, p)
            for r in config.network.regions
            for m in lp_models
            for p in PRIORITIES
        )
        cap = np.array([e.capacity_rps for e in engines], dtype=np.float64)
        elig = np.array(
            [[c.model in e.models and e.role == "both" for e in engines] for c in classes],
            dtype=bool,
        ).reshape(len(classes), len(engines))
        dist = np.array(
            [[config.network.rtt(c.cluster, e.region) / 1e3 for e in engines] for c in classes],
            dtype=np.float64,
        ).reshape(len(classes), len(engines))
        profiles = tuple(by_hw[e.hardware] for e in engines)
        groups = group_engines(profiles, cap, elig, dist)
        pen = ctl.shed_penalties
        pi = {"batch": pen.batch, "default": pen.default, "interactive": pen.interactive}
        # each engine's capacity split equally over the classes eligible on it
        n_on_engine = elig.sum(axis=0)
        share = np.divide(cap, n_on_engine, out=np.zeros_like(cap), where=n_on_engine > 0)
        default = default_fraction * (elig * share).sum(axis=1)
        floor = floor_fraction * (elig * cap).sum(axis=1)
        return cls(
            classes=classes,
            engine_names=tuple(e.name for e in engines),
            engine_ids=np.array([engine_id(e.name) for e in engines], dtype=np.uint64),
            capacity_rps=cap,
            eligible=elig,
            network_latency_s=dist,
            profiles=profiles,
            groups=groups,
            shed_weight=np.array([pi[c.priority] for c in classes], dtype=np.float64),
            default_rps=default,
            floor_rps=floor,
        )

    @property
    def class_keys(self) -> npt.NDArray[np.uint64]:
        """Row keys, table order."""
        return np.array([c.key for c in self.classes], dtype=np.uint64)


@dataclass(frozen=True, eq=False)
class Plan:
    """One solved period, as ``GET /v1/plan`` shows it.

    Attributes
    ----------
    plan_id : int
        Counter of successful plans since start.
    generation : int
        Table generation it was published as.
    created_at_s : float
        Unix time.
    demand_rps, shed_fraction, marginal_cost_s : ndarray, shape (n_classes,)
    measured : ndarray of bool, shape (n_classes,)
        Demand came from reports (else the capacity default).
    x_rps : ndarray, shape (n_classes, n_engines)
        Allocation per engine.
    weights : ndarray, shape (n_classes, n_engines)
        Published rows.
    retry_ratio : float
    result : SolveResult
    health : ndarray, shape (n_engines,), optional
        Health factors ``h`` the plan was solved with (None: all 1).
    engine_flags : ndarray of uint8, shape (n_engines,), optional
        Published ``FLAG_*`` bits (None: all 0).
    """

    plan_id: int
    generation: int
    created_at_s: float
    demand_rps: FloatArray
    measured: npt.NDArray[np.bool_]
    x_rps: FloatArray
    weights: FloatArray
    shed_fraction: FloatArray
    marginal_cost_s: FloatArray
    retry_ratio: float
    result: SolveResult
    health: FloatArray | None = None
    engine_flags: npt.NDArray[np.uint8] | None = None


class ControllerMetrics:
    """Prometheus metrics of one controller (its own registry).

    Parameters
    ----------
    registry : CollectorRegistry, optional
        Default: a new registry.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.solves = Counter(
            "fastroute_controller_solves", "LP solves by outcome status", ["status"], registry=r
        )
        self.solves_reused = Counter(
            "fastroute_controller_solves_reused",
            "Periods (also in solves_total) that reused the last solve's result: same LP inputs",
            registry=r,
        )
        self.solve_seconds = Histogram(
            "fastroute_controller_solve_seconds",
            "Wall time of one period's solve (build + HiGHS + weights)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.generation = Gauge(
            "fastroute_controller_table_generation", "Generation of the published table", registry=r
        )
        self.reports = Counter(
            "fastroute_controller_reports", "Proxy reports by outcome", ["outcome"], registry=r
        )
        self.alerts = Counter(
            "fastroute_controller_alerts",
            "Periods that kept the last good table, by reason",
            ["kind"],
            registry=r,
        )
        self.shed_fraction = Gauge(
            "fastroute_controller_shed_fraction", "Published shed fraction", ["class"], registry=r
        )
        self.demand_rps = Gauge(
            "fastroute_controller_demand_rps", "Forecast demand (req/s)", ["class"], registry=r
        )
        self.engine_health = Gauge(
            "fastroute_controller_engine_health",
            "Derating level h of the engine's capacity (1 healthy, 0 unavailable)",
            ["engine"],
            registry=r,
        )
        self.engine_stale = Gauge(
            "fastroute_controller_engine_stale",
            "1 when the controller has no fresh /metrics scrape of the engine",
            ["engine"],
            registry=r,
        )
        self.engine_scrape_age = Gauge(
            "fastroute_controller_engine_scrape_age_seconds",
            "Age of the last good /metrics scrape of the engine (-1: never)",
            ["engine"],
            registry=r,
        )
        self.scrape_errors = Gauge(
            "fastroute_controller_engine_scrape_errors",
            "Failed scrapes of the engine since start",
            ["engine"],
            registry=r,
        )
        self.config_reloads = Counter(
            "fastroute_controller_config_reloads",
            "SIGHUP config reloads by result (ok, unchanged, error)",
            ["result"],
            registry=r,
        )

    def forget(self, engines: Sequence[str] = (), classes: Sequence[str] = ()) -> None:
        """Drop the per-engine and per-class series of engines / classes a reload removed."""
        for gauge, names in (
            (self.engine_health, engines),
            (self.engine_stale, engines),
            (self.engine_scrape_age, engines),
            (self.scrape_errors, engines),
            (self.shed_fraction, classes),
            (self.demand_rps, classes),
        ):
            for name in names:
                with contextlib.suppress(KeyError):
                    gauge.remove(name)


@dataclass(frozen=True)
class ReloadOutcome:
    """What :meth:`ControllerService.reload` did.

    Attributes
    ----------
    changed : bool
        The config differed and the service now runs on it (False: identical, nothing done).
    needs_restart : tuple of str
        Changes that were not applied (the old value is kept) because only a restart can.
    """

    changed: bool
    needs_restart: tuple[str, ...] = ()


#: State a reload keeps from the running service (everything else comes from the new config).
_KEPT_ON_RELOAD = frozenset(
    {
        "writer",
        "calibration",
        "snapshot",
        "_plan_id",
        "periods_total",
        "last_error",
        "profile_updates_total",
        "reprofiles_total",
        "reloads_total",
        "last_reload_error",
        "_changed",
        "_step_lock",
        "_stop",
        "_scrape_task",
        "metrics",
        "_options",
    }
)
#: Derating and profile-fit state carried over a reload when the engines and settings are equal.
_LEARNT = (
    "signals",
    "health",
    "fitter",
    "fit_group",
    "fit_profiles",
    "_last_window",
    "_shift_log",
    "_shift_windows",
)


def carry_forecast(old: DemandForecaster, new: DemandForecaster) -> int:
    """Copy ``old``'s demand state into ``new`` for the class keys both have; return how many.

    EWMA, held forecast, measured flags, recent peaks and the live workers (with their pending
    and last rates restricted to ``new``'s classes) move over, so a reload neither forgets the
    measured demand nor falls back to the capacity default for classes that still exist.
    """
    # reaches into the forecaster's state: a reload is the only caller that needs it
    o_row, n_row = old._row, new._row
    pairs = [(o_row[k], j) for j, k in enumerate(new.class_keys) if k in o_row]
    for w_id, w in old._workers.items():
        new._workers[w_id] = replace(
            w,
            pending_requests={k: r for k, r in w.pending_requests.items() if k in n_row},
            rates_rps={k: r for k, r in w.rates_rps.items() if k in n_row},
            variances_rps2={k: v for k, v in w.variances_rps2.items() if k in n_row},
        )
    new.unknown_keys_total = old.unknown_keys_total
    if not pairs:
        return 0
    src = np.array([p[0] for p in pairs], dtype=np.intp)
    dst = np.array([p[1] for p in pairs], dtype=np.intp)
    new._ewma_rps[dst] = old._ewma_rps[src]
    new._measured[dst] = old._measured[src]
    new.last_measured_rps[dst] = old.last_measured_rps[src]
    new.last_stderr_rps[dst] = old.last_stderr_rps[src]
    new._held_rps[dst] = old._held_rps[src]
    new._peaks.clear()
    for peak in list(old._peaks)[-(new._peaks.maxlen or 1) :]:
        row = np.full(len(new.class_keys), np.nan)
        row[dst] = peak[src]
        new._peaks.append(row)
    return len(pairs)


#: One period's solve: the LP result, engine weights, shed fractions, per-engine allocation.
PeriodSolution = tuple[SolveResult, FloatArray, FloatArray, FloatArray]


def _solve_period(
    lp: RoutingLP | SiftingLP,
    model: FleetModel,
    demand_rps: FloatArray,
    x_prev_rps: FloatArray | None,
    kappa_s: float,
    shed_base_factor: float,
) -> PeriodSolution:
    """Build, solve and turn into validated engine rows (runs in a worker thread)."""
    g = model.groups
    elig = g.eligible
    slopes_max = max(float(p.slopes_s.max()) for p in g.profiles)
    d_max = float(g.network_latency_s[elig].max(initial=0.0))
    p0 = shed_base_factor * max(slopes_max + d_max + 2.0 * kappa_s, 1e-3)
    problem = RoutingProblem.from_groups(
        demand_rps, g, shed_weight=model.shed_weight, kappa_s=kappa_s, shed_penalty_base_s=p0
    )
    res = lp.solve(problem, x_prev_rps)
    fallback = elig * g.capacity_rps
    wg, sigma = class_weights(res.x_rps, res.shed_rps, demand_rps, fallback=fallback)
    w = engine_weights(wg, g)
    validate_weights(w, sigma)
    return res, w, sigma, g.split(res.x_rps)


class ControllerService:
    """Runs the control loop and holds the current table and plan.

    Parameters
    ----------
    config : Config
    table_name : str, optional
        Shared-memory table to write; default ``config.proxy.table_name``.
    metrics : ControllerMetrics, optional
    default_fraction : float
        Default demand before reports, as a fraction of capacity (see module doc).
    shed_retry_factor : float
        Retry ratio multiplier while any class is shed.
    clock : callable
        Unix seconds (default ``time.time``): report receipt, demand periods and derating windows.
    profile_half_life_windows : float
        Half-life (periods) of the online profile fit (:class:`controller.profiles.ProfileFitter`).
    profile_deadband : float
        A refitted group profile replaces the one in use only when some segment slope moved by more
        than this fraction (small fit noise must not move traffic).
    mode : str
        ``"lp"`` (the optimiser) or ``"p-controller"`` (the legacy baseline,
        :class:`controller.baseline.BaselinePolicy`, for experiments); both publish the same way.
    p_gain, p_ewma_alpha : float
        Gain ``K`` and EWMA factor of the baseline (``p-controller`` mode only).
    republish_after_s : float, optional
        An unchanged plan is still published (new generation) once the table in force is this
        old, so the data planes' table age tells a live controller from a dead one; default
        ``10 · period_s``.
    reprofile_after_windows : int, optional
        An engine derated for latency this many consecutive windows with a *stable* residual
        (see :meth:`reprofile`) gets its own profile and full health back; default
        ``4 · derating.exit_windows``.
    reprofile_max_dispersion_log : float
        "Stable": robust dispersion (1.4826 · MAD) of the windows' log latency ratios at most this.
    health_min_latency_samples : int
        Fewest TTFT (TBOT) samples of an engine in a window for its latency to be scored.
    """

    def __init__(
        self,
        config: Config,
        *,
        table_name: str | None = None,
        metrics: ControllerMetrics | None = None,
        default_fraction: float = 0.5,
        shed_retry_factor: float = 0.2,
        clock: Callable[[], float] = time.time,
        profile_half_life_windows: float = 60.0,
        profile_deadband: float = 0.05,
        mode: str = "lp",
        p_gain: float = 0.5,
        p_ewma_alpha: float = 0.5,
        republish_after_s: float | None = None,
        reprofile_after_windows: int | None = None,
        reprofile_max_dispersion_log: float = 0.1,
        health_min_latency_samples: int = 20,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        # everything but the config, for rebuilding on a reload (:meth:`reload`)
        self._options: dict[str, Any] = {
            "table_name": table_name,
            "default_fraction": default_fraction,
            "shed_retry_factor": shed_retry_factor,
            "clock": clock,
            "profile_half_life_windows": profile_half_life_windows,
            "profile_deadband": profile_deadband,
            "mode": mode,
            "p_gain": p_gain,
            "p_ewma_alpha": p_ewma_alpha,
            "republish_after_s": republish_after_s,
            "reprofile_after_windows": reprofile_after_windows,
            "reprofile_max_dispersion_log": reprofile_max_dispersion_log,
            "health_min_latency_samples": health_min_latency_samples,
        }
        self.mode = mode
        self.config = config
        self.clock = clock
        self.table_name = table_name or config.proxy.table_name
        self.metrics = metrics or ControllerMetrics()
        self.model = FleetModel.from_config(config, default_fraction=default_fraction)
        self.period_s = config.controller.period_s
        self.shed_retry_factor = shed_retry_factor
        self.republish_after_s = (
            10.0 * self.period_s if republish_after_s is None else republish_after_s
        )
        self.forecaster = DemandForecaster(
            [c.key for c in self.model.classes],
            [c.cluster for c in self.model.classes],
            period_s=self.period_s,
        )
        limit_s = config.controller.solve_time_limit_s
        # column generation pays off only on big LPs (ungroupable fleets); tens of groups solve
        # in milliseconds as they are
        self.lp: RoutingLP | SiftingLP = (
            SiftingLP(time_limit_s=limit_s)
            if int(self.model.groups.eligible.sum()) >= SIFTING_MIN_PAIRS
            else RoutingLP(time_limit_s=limit_s)
        )
        m = self.model
        self.signals = SignalAccumulator(m.engine_ids.tolist())
        #: The proxies' reported step-time calibration, published to new workers.
        self.calibration = CalibrationBoard()
        # peers = hardware shape, fixed at start: refitted profiles must not regroup the peers
        self.health = HealthTracker(
            m.profiles,
            m.capacity_rps,
            config.controller.derating,
            engine_names=m.engine_names,
            group=peer_groups(m.profiles),
            min_latency_samples=health_min_latency_samples,
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
            half_life_windows=profile_half_life_windows,
            group_names=["/".join(k) for k in fit_keys],
        )
        self.profile_deadband = profile_deadband
        #: Profile in use per fit group (the seed until a refit passes the deadband).
        self.fit_profiles: list[LatencyProfile] = list(self.fitter.seeds)
        self.profile_updates_total = 0
        self.baseline: BaselinePolicy | None = None
        if mode == "p-controller":
            self.baseline = BaselinePolicy(
                m.eligible, m.engine_names, gain=p_gain, ewma_alpha=p_ewma_alpha
            )
        self._last_window: HealthWindow | None = None
        self.scraper = EngineScraper(
            config.engines,
            interval_s=config.controller.scrape_interval_s,
            timeout_s=config.controller.scrape_timeout_s,
            clock=clock,
        )
        self.last_scrape: ScrapeWindow | None = None
        der = config.controller.derating
        self.reprofile_after_windows = (
            4 * der.exit_windows if reprofile_after_windows is None else reprofile_after_windows
        )
        if self.reprofile_after_windows < 1:
            raise ValueError("reprofile_after_windows must be >= 1")
        self.reprofile_max_dispersion_log = reprofile_max_dispersion_log
        n_e = len(m.engine_names)
        # ring of the last windows' log latency ratios (TTFT, TBOT) while derated for latency
        self._shift_log = np.full((2, n_e, self.reprofile_after_windows), np.nan)
        self._shift_windows = np.zeros(n_e, dtype=np.int64)
        self.reprofiles_total = 0
        for name in m.engine_names:
            self.metrics.engine_health.labels(name).set(1.0)
        self.writer: TableWriter | None = None
        self.snapshot: TableSnapshot | None = None
        self.plan: Plan | None = None
        self.last_error: str | None = None
        self.periods_total = 0
        self._x_prev: FloatArray | None = None
        self._demand_prev: FloatArray | None = None
        self._groups_prev: EngineGroups | None = None
        #: The last successful LP solve, reused while a period's LP inputs are the same.
        self.solve_memo: SolveMemo[PeriodSolution] = SolveMemo()
        self._plan_id = 0
        self._changed = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._scrape_task: asyncio.Task[None] | None = None
        #: Successful reloads that changed the config, and the last failed reload's message
        #: (cleared by the next successful one).
        self.reloads_total = 0
        self.last_reload_error: str | None = None

    # -- life cycle -----------------------------------------------------------------------------

    def open(self) -> None:
        """Open (or take over) the table; raises ``TableLockedError`` if another writer holds it."""
        if self.writer is None:
            n_e, n_g = len(self.model.engine_names), len(self.model.classes)
            self.writer = TableWriter(
                self.table_name, max_engines=max(4096, n_e), max_classes=max(1024, n_g)
            )

    def close(self) -> None:
        """Stop writing. The table file stays: proxies keep routing on the last weights."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current period (never mid-solve)."""
        self._stop.set()

    async def aclose(self) -> None:
        """:meth:`close` once no period is running."""
        async with self._step_lock:
            self.close()

    def start_scrapes(self) -> None:
        """Run :attr:`scraper` in a task (until :meth:`stop_scrapes`; a reload may swap it)."""
        if self._scrape_task is None:
            self._scrape_task = asyncio.create_task(self.scraper.run(), name="controller-scrapes")

    async def stop_scrapes(self) -> None:
        """Cancel the scrape task and close the scraper's HTTP session."""
        task, self._scrape_task = self._scrape_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.scraper.close()

    async def reload(self, config: Config) -> ReloadOutcome:
        """Switch to ``config`` between two periods, keeping the table and its generations.

        The service is rebuilt for the new config (classes, engines, RTTs, profiles seeds, LP,
        controller settings) by constructing a fresh :class:`ControllerService` with the same
        options and adopting its state, so a config the service cannot be built from changes
        nothing. Kept: the table writer (generations only increase), the current snapshot and
        parked long-polls, plan ids, counters, the metrics registry. Carried over: demand
        forecasts of classes that still exist (:func:`carry_forecast`); derating levels and fitted
        profiles when the engines, breakpoints and derating settings are unchanged (else they
        restart from the seeds); the scraper when the engines and scrape settings are unchanged.

        Not applied live (logged, the old value kept, see ``ReloadOutcome.needs_restart``): the
        table name. A new plan is solved and published at once (a new generation even when the
        weights come out equal); until it is, ``plan`` is None.

        Raises
        ------
        ValueError
            The new config cannot be served by this process (the old one stays in force): more
            engines or classes than the open table holds, or the service rejects it.
        """
        async with self._step_lock:
            old = self.config
            needs_restart: list[str] = []
            if self._options["table_name"] is None and config.proxy.table_name != self.table_name:
                needs_restart.append(
                    f"proxy.table_name {self.table_name!r} -> {config.proxy.table_name!r}"
                )
                config = msgspec.structs.replace(
                    config,
                    proxy=msgspec.structs.replace(config.proxy, table_name=self.table_name),
                )
            if config == old:
                return ReloadOutcome(changed=False, needs_restart=tuple(needs_restart))
            # built aside (own throwaway metrics): a config it rejects changes nothing here
            fresh = ControllerService(
                config,
                metrics=ControllerMetrics(),
                **{**self._options, "table_name": self.table_name},
            )
            if self.writer is not None:
                layout = self.writer.layout
                n_e, n_g = len(fresh.model.engine_names), len(fresh.model.classes)
                if n_e > layout.max_engines or n_g > layout.max_classes:
                    raise ValueError(
                        f"the new config has {n_g} classes x {n_e} engines but the open table "
                        f"holds at most {layout.max_classes} x {layout.max_engines}: needs a "
                        "restart"
                    )
            carry_forecast(self.forecaster, fresh.forecaster)
            kept_health = (
                config.engines == old.engines
                and config.controller.breakpoints == old.controller.breakpoints
                and config.controller.derating == old.controller.derating
            )
            if kept_health:
                fresh._adopt_learning(self)
            same_scrapes = config.engines == old.engines and (
                config.controller.scrape_interval_s,
                config.controller.scrape_timeout_s,
            ) == (old.controller.scrape_interval_s, old.controller.scrape_timeout_s)
            scraping = self._scrape_task is not None
            if same_scrapes:
                fresh.scraper = self.scraper
            else:
                await self.stop_scrapes()
            gone_engines = set(self.model.engine_names) - set(fresh.model.engine_names)
            gone_classes = {c.name for c in self.model.classes} - {
                c.name for c in fresh.model.classes
            }
            self.metrics.forget(sorted(gone_engines), sorted(gone_classes))
            for key, value in vars(fresh).items():
                if key not in _KEPT_ON_RELOAD:
                    setattr(self, key, value)
            for name, h in zip(self.model.engine_names, self.health.health, strict=True):
                self.metrics.engine_health.labels(name).set(float(h))
            if scraping and not same_scrapes:
                self.start_scrapes()
            self.reloads_total += 1
            self.last_reload_error = None
            log.info(
                "config reloaded (%d engines, %d classes); derating and profiles %s",
                len(self.model.engine_names),
                len(self.model.classes),
                "kept" if kept_health else "restart from the seeds",
            )
            try:
                await self._step()
            except Exception:  # the plan follows at the next period
                log.exception("first period after the reload failed")
            return ReloadOutcome(changed=True, needs_restart=tuple(needs_restart))

    def _adopt_learning(self, old: ControllerService) -> None:
        """Take ``old``'s derating state and fitted profiles (same engines and settings)."""
        for key in _LEARNT:
            setattr(self, key, getattr(old, key))
        m = self.model
        profiles = tuple(self.fit_profiles[g] for g in self.fit_group)
        groups = group_engines(
            profiles, m.capacity_rps, m.eligible, m.network_latency_s, health=self.health.health
        )
        self.model = replace(m, profiles=profiles, groups=groups)
        self.health.profiles = profiles

    async def run(self) -> None:
        """Step every ``period_s`` until :meth:`stop` (a failed step never ends the loop).

        Stopping instead of cancelling lets a solve running in the worker thread finish before the
        table is closed.
        """
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while not self._stop.is_set():
            try:
                await self.step()
            except Exception:  # the loop must survive anything
                log.exception("controller period failed")
            next_t += self.period_s
            now = loop.time()
            if next_t < now:  # overran: skip missed ticks, keep the phase
                next_t += self.period_s * float(np.ceil((now - next_t) / self.period_s))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), next_t - now)

    # -- inputs ---------------------------------------------------------------------------------

    def observe(self, report: Report) -> None:
        """Feed one decoded proxy report into the demand forecast, the derating window and
        (when it carries one) the calibration board."""
        self.forecaster.observe(report, self.clock())
        self.signals.observe(report)
        if report.calibration is not None:
            self.calibration.observe(report.worker_id, report.calibration)

    # -- one period -----------------------------------------------------------------------------

    def demand(self) -> FloatArray:
        """The current forecast per class (req/s)."""
        return self.forecaster.forecast(self.model.default_rps, self.model.floor_rps)

    async def step(self) -> bool:
        """Run one period; return whether a new table generation was published.

        A plan whose weights, shed fractions and retry ratio equal the published ones (bitwise; the
        κ fixed point makes an unchanged input reproduce them exactly) updates ``plan`` but
        publishes no new generation, so parked long-polls are not woken for nothing; except when
        the table in force is ``republish_after_s`` old (a heartbeat: the proxies' table age then
        stays bounded while the controller lives).
        """
        async with self._step_lock:
            return await self._step()

    def update_health(self, now_s: float) -> list[LevelChange]:
        """Close the signal window: derating levels, then the online profile fit.

        On a level change or a refitted profile the groups are rebuilt. A level change keeps group
        membership (only ``C · h`` changes), so the LP structure and its warm start survive; a
        refit can split or merge groups (the anchor is carried over by :func:`regroup_rates`).
        """
        window = self.signals.drain()
        self._last_window = window
        scraped = self.scraper.drain(now_s)
        self.last_scrape = scraped
        self._scrape_metrics(now_s)
        changes = self.health.update(window, now_s)
        refit = self.learn_profiles(window, scraped)
        reprofiled = self.reprofile(now_s)
        changes += reprofiled
        refit = refit or bool(reprofiled)
        if not changes and not refit:
            return changes
        m = self.model
        groups = group_engines(
            m.profiles, m.capacity_rps, m.eligible, m.network_latency_s, health=self.health.health
        )
        self.model = replace(m, groups=groups)
        for c in changes:
            log.log(
                logging.WARNING if c.new_health < c.old_health else logging.INFO,
                "engine %s health %.2f -> %.2f: %s",
                c.name,
                c.old_health,
                c.new_health,
                c.reason,
            )
            self.metrics.engine_health.labels(c.name).set(c.new_health)
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
            cfg = self.config.controller.derating
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
        cfg = self.config.controller.derating
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

    def _scrape_metrics(self, now_s: float) -> None:
        stale = self.scraper.stale(now_s)
        for i, name in enumerate(self.model.engine_names):
            st = self.scraper.states[i]
            age = st.age_s(now_s)
            self.metrics.engine_stale.labels(name).set(float(stale[i]))
            self.metrics.engine_scrape_age.labels(name).set(-1.0 if age is None else age)
            self.metrics.scrape_errors.labels(name).set(st.errors_total)

    def engine_flags(self) -> npt.NDArray[np.uint8]:
        """``FLAG_UNAVAILABLE`` for engines derated to 0, else 0."""
        return np.where(self.health.health <= 0.0, FLAG_UNAVAILABLE, 0).astype(np.uint8)

    async def _step(self) -> bool:
        self.periods_total += 1
        now_s = self.clock()
        self.forecaster.update(now_s)
        self.update_health(now_s)
        health = self.health.health
        flags = self.engine_flags()
        demand = self.demand()
        measured = self.forecaster.measured
        ctl = self.config.controller
        anchor = None
        if self._x_prev is not None and self._demand_prev is not None:
            x_prev = self._x_prev
            old, new = self._groups_prev, self.model.groups
            if old is not None and not np.array_equal(old.group_of_engine, new.group_of_engine):
                x_prev = regroup_rates(x_prev, old, new)
            anchor = table_anchor(x_prev, self._demand_prev, demand)
        groups_now = self.model.groups
        t0 = time.perf_counter()
        reused = False
        try:
            if self.baseline is not None:
                res, w, sigma, x_eng = await asyncio.to_thread(
                    self._baseline_period, demand, now_s, flags
                )
            else:
                inputs = SolveInputs(
                    self.lp, self.model, demand, anchor, ctl.kappa_s, ctl.shed_base_factor
                )
                solution = self.solve_memo.get(inputs)
                reused = solution is not None
                if solution is None:
                    solution = await asyncio.to_thread(
                        _solve_period,
                        self.lp,
                        self.model,
                        demand,
                        anchor,
                        ctl.kappa_s,
                        ctl.shed_base_factor,
                    )
                    self.solve_memo.put(inputs, solution)
                res, w, sigma, x_eng = solution
        except SolveError as exc:
            self.solve_memo.forget()
            self.metrics.solves.labels(status=exc.status).inc()
            self._alert("solve_error", str(exc))
            return False
        except (TableError, ValueError) as exc:
            self.solve_memo.forget()
            self.metrics.solves.labels(status="invalid").inc()
            self._alert("invalid_weights", str(exc))
            return False
        # every period counts by its plan's status (alerts watch that rate); timings are solves'
        self.metrics.solves.labels(status=res.status).inc()
        if reused:
            self.metrics.solves_reused.inc()
        else:
            self.metrics.solve_seconds.observe(time.perf_counter() - t0)
        if self.baseline is None:
            # the LP planned for the held forecast; a shed class's fraction must admit its routed
            # rate out of the live demand estimate (controller.weights.shed_at_demand)
            live = self.forecaster.forecast(
                self.model.default_rps, self.model.floor_rps, held=False
            )
            sigma = shed_at_demand(res.x_rps, res.shed_rps, live)
        retry = self.config.retry.ratio
        if float(sigma.max(initial=0.0)) > 1e-9:
            retry *= self.shed_retry_factor
        plan_id = self._plan_id + 1
        meta: dict[str, Any] = {
            "plan_id": plan_id,
            "status": res.status,
            "objective": res.objective,
            "solve_time_s": res.solve_time_s,
        }
        prev = self.plan
        unchanged = (
            prev is not None
            and self.snapshot is not None
            and prev.retry_ratio == retry
            and np.array_equal(prev.weights, w)
            and np.array_equal(prev.shed_fraction, sigma)
            and prev.engine_flags is not None
            and np.array_equal(prev.engine_flags, flags)
            and self.clock() - self.snapshot.published_at < self.republish_after_s
        )
        if unchanged:  # nothing for the data planes: no new generation, no long-poll wake-up
            snap = self.snapshot
            assert snap is not None
        else:
            try:
                snap = await asyncio.to_thread(self._publish, w, sigma, retry, meta, flags)
            except (TableError, ValueError, OSError) as exc:
                self._alert("publish_error", str(exc))
                return False
        self._plan_id = plan_id
        if self.baseline is None:
            self._x_prev = res.x_rps
            self._demand_prev = demand
            self._groups_prev = groups_now
        self.snapshot = snap
        self.plan = Plan(
            plan_id=plan_id,
            generation=snap.generation,
            created_at_s=snap.published_at,
            demand_rps=demand,
            measured=measured,
            x_rps=x_eng,
            weights=w,
            shed_fraction=sigma,
            marginal_cost_s=res.marginal_cost_s,
            retry_ratio=retry,
            result=res,
            health=health,
            engine_flags=flags,
        )
        if self.last_error is not None:
            log.info("controller recovered: plan %d published", plan_id)
        self.last_error = None
        self.metrics.generation.set(snap.generation)
        for c, s, d in zip(self.model.classes, sigma, demand, strict=True):
            self.metrics.shed_fraction.labels(c.name).set(float(s))
            self.metrics.demand_rps.labels(c.name).set(float(d))
        if unchanged:
            return False
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    def _baseline_period(
        self, demand: FloatArray, now_s: float, flags: npt.NDArray[np.uint8]
    ) -> tuple[SolveResult, FloatArray, FloatArray, FloatArray]:
        """One ``p-controller`` period: nudge the weights by the window's latencies."""
        assert self.baseline is not None
        t0 = time.perf_counter()
        window = self._last_window or HealthWindow.empty(len(self.model.engine_names))
        latency = window_latency_s(window, self.model.profiles)
        w = self.baseline.step(latency, now_s, available=(flags & FLAG_UNAVAILABLE) == 0)
        sigma = np.zeros(w.shape[0])
        validate_weights(w, sigma)
        x = w * demand[:, None]
        res = SolveResult(
            x_rps=x,
            shed_rps=sigma.copy(),
            objective=0.0,
            marginal_cost_s=np.zeros(w.shape[0]),
            load_rps=x.sum(axis=0),
            status="p-controller",
            iterations=0,
            solve_time_s=time.perf_counter() - t0,
            build_time_s=0.0,
            warm=False,
        )
        return res, w, sigma, x

    def _publish(
        self,
        w: FloatArray,
        sigma: FloatArray,
        retry: float,
        meta: dict[str, Any],
        flags: npt.NDArray[np.uint8] | None = None,
    ) -> TableSnapshot:
        if self.writer is None:
            raise TableError("the table is not open")
        snap = TableSnapshot.validated(
            self.writer.generation + 1,
            self.model.engine_ids,
            w,
            class_keys=self.model.class_keys,
            engine_flags=flags,
            shed_fraction=sigma,
            retry_ratio=retry,
            published_at=self.clock(),
            meta=meta,
        )
        self.writer.write(snap)  # the same object the HTTP side serves
        return snap

    def _alert(self, kind: str, message: str) -> None:
        self.metrics.alerts.labels(kind=kind).inc()
        if message != self.last_error:
            log.error("controller keeps the last good table (%s): %s", kind, message)
        self.last_error = message

    # -- long-poll support ----------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Generation of the current snapshot, 0 before the first."""
        return 0 if self.snapshot is None else self.snapshot.generation

    async def wait_changed(self, after: int, timeout_s: float) -> TableSnapshot | None:
        """The current snapshot once its generation differs from ``after``; None on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.snapshot is None or self.snapshot.generation == after:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self.snapshot

    # -- explain --------------------------------------------------------------------------------

    def plan_json(self) -> dict[str, Any]:
        """The current plan as a JSON-able dict (``GET /v1/plan``)."""
        m = self.model
        flags = self.engine_flags()
        now_s = self.clock()
        engines: list[dict[str, Any]] = []
        for i, (name, cap) in enumerate(zip(m.engine_names, m.capacity_rps, strict=True)):
            d = self.health.state(i)
            scrape = self.scraper.state(i, now_s)
            engines.append(
                {
                    "name": name,
                    "capacity_rps": float(cap),
                    "effective_capacity_rps": float(m.groups.engine_capacity_rps[i]),
                    "group": int(m.groups.group_of_engine[i]),
                    "fit_group": self.fitter.group_names[int(self.fit_group[i])],
                    "scrape": scrape,
                    # flat copies for the HTML page: the last scraped gauges and their age
                    "signals": {
                        k: scrape[k]
                        for k in ("running", "waiting", "kv_cache_usage")
                        if scrape[k] is not None
                    }
                    | ({"stale": 1} if scrape["stale"] else {}),
                    "signals_age_s": scrape["age_s"],
                    "load_rps": None if self.plan is None else float(self.plan.x_rps[:, i].sum()),
                    "unavailable": bool(flags[i] & FLAG_UNAVAILABLE),
                    "derating": d,
                    # flat copies for the HTML page (controller.plan_page)
                    "health_level": d["level"],
                    "health_reason": d["reason"],
                    "health_since": d["since"],
                }
            )
        out: dict[str, Any] = {
            "mode": self.mode,
            "plan_id": None,
            "generation": self.generation,
            "period_s": self.period_s,
            "periods_total": self.periods_total,
            "last_error": self.last_error,
            "live_workers": self.forecaster.live_workers,
            "engines": engines,
            "profiles": self.fitter.state(),
            "profile_updates_total": self.profile_updates_total,
            "reprofiles_total": self.reprofiles_total,
            "classes": [],
        }
        p = self.plan
        if p is None:
            return out
        r = p.result
        out.update(
            plan_id=p.plan_id,
            generation=p.generation,
            created_at=p.created_at_s,
            retry_ratio=p.retry_ratio,
            solve={
                "status": r.status,
                "objective": r.objective,
                "solve_time_s": r.solve_time_s,
                "build_time_s": r.build_time_s,
                "iterations": r.iterations,
                "warm": r.warm,
            },
        )
        out["classes"] = [
            {
                "name": c.name,
                "key": c.key,
                "cluster": c.cluster,
                "model": c.model,
                "priority": c.priority,
                "demand_rps": float(p.demand_rps[g]),
                "measured": bool(p.measured[g]),
                "shed_fraction": float(p.shed_fraction[g]),
                "marginal_cost_s": float(p.marginal_cost_s[g]),
                "allocation_rps": _nonzero(m.engine_names, p.x_rps[g]),
                "weights": _nonzero(m.engine_names, p.weights[g]),
            }
            for g, c in enumerate(m.classes)
        ]
        return out


def _nonzero(names: Sequence[str], row: FloatArray) -> dict[str, float]:
    return {n: float(v) for n, v in zip(names, row, strict=True) if v > 0}
