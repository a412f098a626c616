"""The control plane's interface in the simulator: signals in, a weight table out.

The optimiser is *injected*: any callable ``optimiser(ControlInput) -> ControlOutput``.
Two simple ones live here (``static``, ``nearest``); the real ones — the controller's
routing LP and its proportional baseline — are built by ``controller.sim_optimiser``,
which :func:`make_optimiser` imports lazily by name, so ``fastroute`` never imports
``controller`` (docs/design.md §6).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "EngineWindow",
    "ControlInput",
    "ControlOutput",
    "Optimiser",
    "static_optimiser",
    "nearest_optimiser",
    "make_optimiser",
    "BUILTIN_OPTIMISERS",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass
class EngineWindow:
    """Per-engine signals of one control period, as the data planes would report them.

    All arrays have shape ``(n_engines,)``. Latencies are measured at the data plane
    (network included), per finished attempt.
    """

    ttft_count: IntArray
    ttft_sum_s: FloatArray
    tbot_count: IntArray
    tbot_sum_s: FloatArray
    e2e_count: IntArray
    e2e_sum_s: FloatArray
    attempts: IntArray
    errors: IntArray
    load_rps: FloatArray

    @classmethod
    def empty(cls, n: int) -> EngineWindow:
        """A window without samples."""
        zi = np.zeros(n, dtype=np.int64)
        zf = np.zeros(n, dtype=np.float64)
        return cls(
            zi, zf, zi.copy(), zf.copy(), zi.copy(), zf.copy(), zi.copy(), zi.copy(), zf.copy()
        )


@dataclass
class ControlInput:
    """What the optimiser knows at one control step.

    Attributes
    ----------
    now_s : float
        Virtual time of the step.
    period_s : float
        Control period.
    engine_names, engine_regions, engine_models : tuple of str
        Per engine (table order).
    class_labels, class_sources, class_models : tuple of str
        Per class row (``class_roles`` says ``"mixed"``, ``"prefill"`` or ``"decode"``).
    class_roles : tuple of str
    demand_rps : ndarray, shape (n_classes,)
        Arrival rate per class in the observed window (lagged).
    eligible : ndarray of bool, shape (n_classes, n_engines)
        Engines that serve each class (model and role).
    network_latency_s : ndarray, shape (n_classes, n_engines)
        Round trip from the class's region to the engine's region.
    capacity_rps : ndarray, shape (n_engines,)
        Nominal capacity (req/s at ρ = 1).
    idle_ttft_s, idle_tbot_s : ndarray, shape (n_engines,)
        Model-predicted TTFT and TBOT of a typical request on an idle engine.
    mean_output_tokens : float
        Mean output length of the workload.
    window : EngineWindow
        Engine signals of the observed (lagged) window.
    weights : ndarray, shape (n_classes, n_engines)
        The table currently published.
    engine_tokens : ndarray, shape (3, n_engines)
        Each engine's cumulative (queried, cached, generated) token counters, as its
        ``/metrics`` would show them now (the controller windows them for the reuse gain).
    """

    now_s: float
    period_s: float
    engine_names: tuple[str, ...]
    engine_regions: tuple[str, ...]
    engine_models: tuple[str, ...]
    class_labels: tuple[str, ...]
    class_sources: tuple[str, ...]
    class_models: tuple[str, ...]
    class_roles: tuple[str, ...]
    demand_rps: FloatArray
    eligible: npt.NDArray[np.bool_]
    network_latency_s: FloatArray
    capacity_rps: FloatArray
    idle_ttft_s: FloatArray
    idle_tbot_s: FloatArray
    mean_output_tokens: float
    window: EngineWindow
    weights: FloatArray
    engine_tokens: FloatArray | None = None


@dataclass
class ControlOutput:
    """A new table: weight rows (sum 1 or all zero) and shed fractions per class.

    Attributes
    ----------
    weights : ndarray, shape (n_classes, n_engines)
    shed_fraction : ndarray, shape (n_classes,)
    info : dict
        Optimiser diagnostics recorded in the time series (JSON-serialisable values).
    """

    weights: FloatArray
    shed_fraction: FloatArray
    info: dict[str, Any] = field(default_factory=dict)


#: An optimiser: called once per control period.
Optimiser = Callable[[ControlInput], ControlOutput]


def _proportional(mask: np.ndarray, capacity: np.ndarray) -> FloatArray:
    w = mask * capacity[None, :]
    s = w.sum(axis=1, keepdims=True)
    return np.divide(w, s, out=np.zeros_like(w), where=s > 0)


def static_optimiser(**params: Any) -> Optimiser:
    """Capacity-proportional weights over eligible engines; no shedding, no feedback."""
    if params:
        raise ValueError(f"static optimiser takes no parameters, got {sorted(params)}")

    def optimise(inp: ControlInput) -> ControlOutput:
        w = _proportional(inp.eligible.astype(np.float64), inp.capacity_rps)
        return ControlOutput(w, np.zeros(len(inp.class_labels)))

    return optimise


def nearest_optimiser(**params: Any) -> Optimiser:
    """Each class to the eligible engines of its own region (capacity-proportional);
    classes whose region has none fall back to every eligible engine."""
    if params:
        raise ValueError(f"nearest optimiser takes no parameters, got {sorted(params)}")

    def optimise(inp: ControlInput) -> ControlOutput:
        regions = np.array(inp.engine_regions)
        local = np.array([regions == src for src in inp.class_sources]) & inp.eligible
        none_local = ~local.any(axis=1)
        mask = np.where(none_local[:, None], inp.eligible, local)
        w = _proportional(mask.astype(np.float64), inp.capacity_rps)
        return ControlOutput(w, np.zeros(len(inp.class_labels)))

    return optimise


#: Optimisers that need nothing outside fastroute.
BUILTIN_OPTIMISERS: dict[str, Callable[..., Optimiser]] = {
    "static": static_optimiser,
    "nearest": nearest_optimiser,
}

#: Module that provides the controller's optimisers (loaded by name: fastroute never
#: imports controller).
CONTROLLER_GLUE = "controller.sim_optimiser"


def make_optimiser(name: str, params: dict[str, Any] | None = None) -> Optimiser:
    """Build optimiser ``name`` with ``params``.

    Built-ins first, then ``controller.sim_optimiser.make_optimiser(name, **params)``.

    Raises
    ------
    ValueError
        Unknown name or bad parameters (the message lists the known names).
    """
    params = dict(params or {})
    if name in BUILTIN_OPTIMISERS:
        return BUILTIN_OPTIMISERS[name](**params)
    try:
        glue = importlib.import_module(CONTROLLER_GLUE)
    except ImportError as exc:
        raise ValueError(
            f"optimiser {name!r} needs the controller package ({CONTROLLER_GLUE}): {exc}"
        ) from None
    known = sorted(BUILTIN_OPTIMISERS) + sorted(glue.OPTIMISERS)
    if name not in glue.OPTIMISERS:
        raise ValueError(f"unknown optimiser {name!r}; known: {', '.join(known)}")
    return glue.make_optimiser(name, **params)
