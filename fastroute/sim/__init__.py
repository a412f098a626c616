"""Discrete-event simulator of a fastroute deployment (docs/simulator.md).

The simulator drives the emulator's engine performance model
(:class:`fastroute.emulator.model.EngineModel`) in virtual time, routes with the
proxy's own policy, retry-budget, ejection and admission objects, and runs the
control plane's optimiser (injected) in the loop. Metrics are defined in
docs/metrics.md and computed by :mod:`fastroute.sim.metrics` from
:class:`fastroute.sim.records.RequestRecord`, which the fleet benchmark reuses.

Names are imported lazily, so ``fastroute sim --help`` (which imports
:mod:`fastroute.sim.cli`) does not load numpy and the engine model.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ControlInput",
    "ControlOutput",
    "EngineWindow",
    "RequestRecord",
    "Scenario",
    "ScenarioError",
    "SimResult",
    "Simulator",
    "Slo",
    "load_scenario",
    "make_optimiser",
    "summarize",
    "run_sweep",
]

_WHERE = {
    "ControlInput": "fastroute.sim.control",
    "ControlOutput": "fastroute.sim.control",
    "EngineWindow": "fastroute.sim.control",
    "make_optimiser": "fastroute.sim.control",
    "SimResult": "fastroute.sim.core",
    "Simulator": "fastroute.sim.core",
    "Slo": "fastroute.sim.metrics",
    "summarize": "fastroute.sim.metrics",
    "RequestRecord": "fastroute.sim.records",
    "Scenario": "fastroute.sim.scenario",
    "ScenarioError": "fastroute.sim.scenario",
    "load_scenario": "fastroute.sim.scenario",
    "run_sweep": "fastroute.sim.sweep",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fastroute.sim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
