"""controller.publish: the table, the snapshot in force, the republish rule and the long-poll."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from controller.model import FleetModel, Plan
from controller.publish import TablePublisher
from controller.solve import SolveResult
from fastroute.config import decode_config
from fastroute.errors import TableError
from fastroute.tables import TableReader

MODEL = "demo-8b"


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10.0))


def fleet() -> FleetModel:
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["{MODEL}"]\nregion = "east"\nhardware = "h100"\ncapacity_rps = 10.0\n\n'
        for i in range(2)
    )
    toml = engines + '[[network.regions]]\nname = "east"\n\n[proxy]\ncluster = "east"\n'
    return FleetModel.from_config(decode_config(toml, source="test.toml"))


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_000.0

    def __call__(self) -> float:
        return self.now_s


def rows(model: FleetModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_g, n_e = len(model.classes), len(model.engine_names)
    return np.full((n_g, n_e), 1.0 / n_e), np.zeros(n_g), np.zeros(n_e, dtype=np.uint8)


def plan_of(generation: int, w: np.ndarray, sigma: np.ndarray, flags: np.ndarray) -> Plan:
    n_g, n_e = w.shape
    res = SolveResult(
        x_rps=w,
        shed_rps=sigma,
        objective=0.0,
        marginal_cost_s=np.zeros(n_g),
        load_rps=np.zeros(n_e),
        status="Optimal",
        iterations=0,
        solve_time_s=0.0,
        build_time_s=0.0,
        warm=False,
    )
    return Plan(
        plan_id=1,
        generation=generation,
        created_at_s=0.0,
        demand_rps=np.ones(n_g),
        measured=np.zeros(n_g, dtype=bool),
        x_rps=w,
        weights=w,
        shed_fraction=sigma,
        marginal_cost_s=np.zeros(n_g),
        retry_ratio=0.1,
        result=res,
        engine_flags=flags,
    )


def test_publish_writes_the_table_and_keeps_the_snapshot(shm_name: str) -> None:
    """A publish is a new generation in the shared-memory table and the snapshot in force; a
    closed publisher refuses to publish and leaves the table in place."""
    model, clock = fleet(), Clock()
    w, sigma, flags = rows(model)
    pub = TablePublisher(shm_name, clock, republish_after_s=10.0)
    assert pub.generation == 0 and pub.snapshot is None

    async def main() -> None:
        pub.open(len(model.engine_names), len(model.classes))
        try:
            snap = await pub.publish(model, w, sigma, 0.1, {"plan_id": 1}, flags)
            assert pub.snapshot is snap and pub.generation == snap.generation > 0
            assert snap.published_at == clock.now_s
            reader = TableReader(shm_name)
            try:
                assert reader.snapshot().generation == snap.generation
            finally:
                reader.close()
        finally:
            pub.close()
        with pytest.raises(TableError, match="not open"):
            await pub.publish(model, w, sigma, 0.1, {}, flags)

    run(main())


def test_unchanged_until_the_content_differs_or_the_table_is_old(shm_name: str) -> None:
    """The plan in force already publishes bitwise-equal content, until the retry ratio,
    weights, shed fractions or flags differ, or the table is ``republish_after_s`` old."""
    model, clock = fleet(), Clock()
    w, sigma, flags = rows(model)
    pub = TablePublisher(shm_name, clock, republish_after_s=5.0)
    assert not pub.unchanged(None, w, sigma, 0.1, flags)

    async def main() -> None:
        pub.open(len(model.engine_names), len(model.classes))
        try:
            snap = await pub.publish(model, w, sigma, 0.1, {}, flags)
            prev = plan_of(snap.generation, w, sigma, flags)
            assert not pub.unchanged(None, w, sigma, 0.1, flags)
            assert pub.unchanged(prev, w.copy(), sigma.copy(), 0.1, flags.copy())
            assert not pub.unchanged(prev, w, sigma, 0.2, flags)
            w2 = w.copy()
            w2[0] = [1.0, 0.0]
            assert not pub.unchanged(prev, w2, sigma, 0.1, flags)
            assert not pub.unchanged(prev, w, sigma + 0.5, 0.1, flags)
            assert not pub.unchanged(prev, w, sigma, 0.1, flags + 1)
            assert not pub.unchanged(replace(prev, engine_flags=None), w, sigma, 0.1, flags)
            clock.now_s += 4.9
            assert pub.unchanged(prev, w, sigma, 0.1, flags)
            clock.now_s += 0.1  # the heartbeat: as old as republish_after_s
            assert not pub.unchanged(prev, w, sigma, 0.1, flags)
        finally:
            pub.close()

    run(main())


def test_wait_changed_wakes_on_a_new_generation_or_times_out(shm_name: str) -> None:
    """A parked long-poll returns the new snapshot once notified; with nothing new it returns
    None at its timeout; a generation other than ``after`` answers at once."""
    model = fleet()
    w, sigma, flags = rows(model)
    pub = TablePublisher(shm_name, Clock(), republish_after_s=5.0)

    async def main() -> None:
        pub.open(len(model.engine_names), len(model.classes))
        try:
            assert await pub.wait_changed(0, 0.05) is None
            parked = asyncio.create_task(pub.wait_changed(0, 5.0))
            await asyncio.sleep(0.01)
            assert not parked.done()
            snap = await pub.publish(model, w, sigma, 0.1, {}, flags)
            pub.notify_changed()
            assert await parked is snap
            assert await pub.wait_changed(snap.generation, 0.05) is None
            assert await pub.wait_changed(snap.generation - 1, 0.0) is snap
        finally:
            pub.close()

    run(main())


def test_wait_changed_wakes_a_poller_of_another_epoch_on_the_same_generation(
    shm_name: str,
) -> None:
    """A new leader's first generation can equal the old leader's that a proxy polls after: the
    epoch tells them apart, so the parked poll answers at the first publish, not a later one."""
    model = fleet()
    w, sigma, flags = rows(model)
    pub = TablePublisher(shm_name, Clock(), republish_after_s=5.0)

    async def main() -> None:
        pub.open(len(model.engine_names), len(model.classes))
        try:
            parked = asyncio.create_task(pub.wait_changed(1, 5.0, "3"))  # old leader: gen 1
            await asyncio.sleep(0.01)
            snap = await pub.publish(model, w, sigma, 0.1, {"epoch": 9}, flags)
            pub.notify_changed()
            assert snap.generation == 1 and await parked is snap
            assert await pub.wait_changed(1, 0.05, "9") is None  # same table, same epoch: parks
        finally:
            pub.close()

    run(main())
