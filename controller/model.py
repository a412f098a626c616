"""The controller's fleet model: demand classes, the static LP data from the config, and a plan.

:class:`FleetModel` is built once from the config (:meth:`FleetModel.from_config`) and replaced,
never mutated, when learning refits profiles or regroups engines
(:class:`controller.learning.FleetLearning`). :class:`Plan` is one solved and published period as
``GET /v1/plan`` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controller.groups import EngineGroups, group_engines
from controller.latency import LatencyProfile
from controller.solve import SolveResult
from fastroute.config import PRIORITIES, Config
from fastroute.hardware import PROFILES, seed_latency_s
from fastroute.hashing import class_key, engine_id

__all__ = [
    "FALLBACK_SEED_LATENCY_S",
    "HARDWARE_SEED_LATENCY_S",
    "ClassSpec",
    "FleetModel",
    "Plan",
]

FloatArray = npt.NDArray[np.float64]

#: Idle (TTFT₀, TBOT₀) in seconds per hardware class, for the seed profiles
#: ``TTFT(ρ) = TTFT₀/(1−ρ)``, ``TBOT(ρ) = TBOT₀(1 + 0.8ρ)``: the datasheet's figures
#: (:func:`fastroute.hardware.seed_latency_s`) of every built-in profile that has them.
HARDWARE_SEED_LATENCY_S: dict[str, tuple[float, float]] = {
    name: seed for name in PROFILES if (seed := seed_latency_s(name)) is not None
}
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
        # routes their pools by capacity (fastroute/proxy/path/pd.py). A row without an
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
