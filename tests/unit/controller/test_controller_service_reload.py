"""ControllerService.reload: rebuild for a new config, same table, forecasts carried over.

The service is driven in-process with :meth:`ControllerService.step` (no loop, no scrapes: the
engine URLs are never contacted); its table is a real shared-memory segment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np
import pytest

from controller.options import ControllerOptions
from controller.planner import PControllerPlanner
from controller.service import ControllerService
from fastroute.config import PRIORITIES, Config, decode_config
from fastroute.hashing import class_key
from fastroute.signals.reports import ClassDemand, Report

MODEL = "demo-8b"


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20.0))


def config(
    table: str,
    *,
    capacities: tuple[float, ...] = (10.0, 10.0),
    regions: tuple[str, ...] = ("east",),
    kappa_s: float = 0.4,
) -> Config:
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["{MODEL}"]\nregion = "east"\nhardware = "h100"\ncapacity_rps = {cap}\n\n'
        for i, cap in enumerate(capacities)
    )
    regs = "".join(f'[[network.regions]]\nname = "{r}"\n\n' for r in regions)
    if "north" in regions:
        regs += "[network.rtt_ms]\neast = { north = 40.0 }\n\n"
    return decode_config(
        engines
        + regs
        + f"[controller]\nperiod_s = 0.2\nsolve_time_limit_s = 0.15\nkappa_s = {kappa_s}\n\n"
        + f'[proxy]\ncluster = "east"\ntable_name = "{table}"\n',
        source="test.toml",
    )


def report(requests: int, now_s: float, priority: str = "default") -> Report:
    classes = [ClassDemand(class_key=class_key("east", MODEL, priority), requests=requests)]
    return Report(1, "east", "w-1", now_s - 1.0, now_s, classes, [])


def plan_engine(svc: ControllerService, name: str) -> dict[str, Any]:
    return next(e for e in svc.plan_json()["engines"] if e["name"] == name)


def test_reload_rebuilds_on_the_same_table_and_generations_increase(shm_name: str) -> None:
    """A new capacity and a new engine show in the plan after the reload, which publishes a new
    generation at once on the same table; an identical config changes nothing."""

    async def main() -> None:
        svc = ControllerService(config(shm_name))
        svc.open()
        try:
            await svc.step()
            writer, gen = svc.publisher.writer, svc.generation
            assert gen >= 1 and plan_engine(svc, "engine-0")["capacity_rps"] == 10.0
            out = await svc.reload(config(shm_name, capacities=(25.0, 10.0, 5.0)))
            assert out.changed and out.needs_restart == ()
            assert svc.publisher.writer is writer and svc.generation == gen + 1
            assert plan_engine(svc, "engine-0")["capacity_rps"] == 25.0
            assert [e["name"] for e in svc.plan_json()["engines"]] == [
                "engine-0",
                "engine-1",
                "engine-2",
            ]
            assert svc.snapshot is not None and svc.snapshot.n_engines == 3
            assert svc.plan is not None and svc.plan.weights.shape == (3, 3)
            await svc.step()
            assert svc.generation >= gen + 1  # never backwards
            before = svc.generation
            same = await svc.reload(config(shm_name, capacities=(25.0, 10.0, 5.0)))
            assert not same.changed and svc.generation == before and svc.reloads_total == 1
        finally:
            svc.close()

    run(main())


def test_reload_carries_measured_demand_of_classes_that_remain(shm_name: str) -> None:
    """Measured demand of east/default survives a reload that adds a region; the new region's
    classes start from the capacity default."""

    async def main() -> None:
        svc = ControllerService(config(shm_name))
        svc.open()
        try:
            now = time.time()
            svc.observe(report(12, now))
            await svc.step()
            row = [c.name for c in svc.model.classes].index(f"east/{MODEL}/default")
            measured_rps = float(svc.demand()[row])
            assert measured_rps == pytest.approx(12.0)
            await svc.reload(config(shm_name, regions=("east", "north")))
            names = [c.name for c in svc.model.classes]
            assert len(names) == 2 * len(PRIORITIES)
            demand = svc.demand()
            assert demand[names.index(f"east/{MODEL}/default")] == pytest.approx(measured_rps)
            north = names.index(f"north/{MODEL}/default")
            assert not svc.forecaster.measured[north]
            assert demand[north] == pytest.approx(svc.model.default_rps[north])
        finally:
            svc.close()

    run(main())


def test_reload_keeps_derating_state_only_while_the_engines_are_unchanged(shm_name: str) -> None:
    """A controller-settings change keeps the health tracker and profile fit; changed engines
    restart them from the seeds."""

    async def main() -> None:
        svc = ControllerService(config(shm_name))
        svc.open()
        try:
            await svc.step()
            health, fitter = svc.learning.health, svc.learning.fitter
            await svc.reload(config(shm_name, kappa_s=0.8))
            assert svc.config.controller.kappa_s == 0.8
            assert svc.learning.health is health and svc.learning.fitter is fitter
            await svc.reload(config(shm_name, kappa_s=0.8, capacities=(10.0, 20.0)))
            assert svc.learning.health is not health and svc.learning.fitter is not fitter
            np.testing.assert_array_equal(svc.learning.health.health, [1.0, 1.0])
        finally:
            svc.close()

    run(main())


def test_a_new_table_name_needs_a_restart(shm_name: str) -> None:
    """The table name is not applied live: reported, old name kept, other changes applied."""

    async def main() -> None:
        svc = ControllerService(config(shm_name))
        svc.open()
        try:
            await svc.step()
            out = await svc.reload(config(shm_name + "-other", kappa_s=0.7))
            assert out.changed and len(out.needs_restart) == 1
            assert "table_name" in out.needs_restart[0]
            assert svc.table_name == shm_name and svc.config.proxy.table_name == shm_name
            assert svc.config.controller.kappa_s == 0.7
            # only the table name differs: nothing to do, still reported
            out = await svc.reload(config(shm_name + "-other", kappa_s=0.7))
            assert not out.changed and len(out.needs_restart) == 1
        finally:
            svc.close()

    run(main())


def test_reload_in_p_controller_mode_rebuilds_the_baseline(shm_name: str) -> None:
    """The legacy baseline's per-engine state follows the new engine set."""

    async def main() -> None:
        svc = ControllerService(config(shm_name), ControllerOptions(mode="p-controller"))
        svc.open()
        try:
            await svc.step()
            gen = svc.generation
            await svc.reload(config(shm_name, capacities=(10.0, 10.0, 10.0)))
            assert isinstance(svc.planner, PControllerPlanner)
            assert svc.planner.mode == "p-controller"
            assert svc.plan is not None and svc.plan.weights.shape == (3, 3)
            assert svc.plan.result.status == "p-controller" and svc.generation == gen + 1
            np.testing.assert_allclose(svc.plan.weights.sum(axis=1), 1.0)
        finally:
            svc.close()

    run(main())
