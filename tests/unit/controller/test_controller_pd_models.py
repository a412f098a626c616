"""P/D models have no LP rows: the controller never sheds a model it cannot route.

A model served only by ``prefill`` and ``decode`` engines is routed by the proxy's P/D path
over capacity-proportional pools; a table row for it would have no eligible engine and be
shed in full (every request a 429 ``load_shed``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import numpy as np

from controller.model import FleetModel
from controller.service import ControllerService
from fastroute.config import PRIORITIES, Config, decode_config
from fastroute.hashing import class_key
from fastroute.signals.reports import ClassDemand, Report


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20.0))


def config(table: str, *, colocated: bool) -> Config:
    engines = [
        ("p-0", "pd-3b", "prefill"),
        ("d-0", "pd-3b", "decode"),
        ("d-1", "pd-3b", "decode"),
    ]
    if colocated:
        engines += [("m-0", "demo-8b", "both"), ("m-1", "demo-8b", "both")]
    text = "".join(
        f'[[engines]]\nname = "{name}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["{model}"]\nrole = "{role}"\nregion = "east"\ncapacity_rps = 10.0\n\n'
        for i, (name, model, role) in enumerate(engines)
    )
    return decode_config(
        text
        + '[[network.regions]]\nname = "east"\n\n'
        + "[controller]\nperiod_s = 0.2\nsolve_time_limit_s = 0.15\n\n"
        + f'[proxy]\ncluster = "east"\ntable_name = "{table}"\n',
        source="test.toml",
    )


def test_only_models_with_colocated_engines_get_rows() -> None:
    """Rows for demo-8b (served by `both` engines), none for the P/D model."""
    model = FleetModel.from_config(config("unused", colocated=True))
    assert {c.model for c in model.classes} == {"demo-8b"}
    assert len(model.classes) == len(PRIORITIES)
    assert model.eligible.any(axis=1).all()  # every row has an engine


def test_a_pd_model_is_never_shed_and_the_colocated_one_is_served(shm_name: str) -> None:
    """With light demand reported for both models, the table sheds nothing and has no
    row for the P/D model (the proxy then uses capacity weights, shed 0)."""

    async def main() -> None:
        svc = ControllerService(config(shm_name, colocated=True))
        svc.open()
        try:
            now = 1_000.0
            keys = [class_key("east", m, "default") for m in ("demo-8b", "pd-3b")]
            demand = [ClassDemand(class_key=k, requests=4) for k in keys]
            svc.observe(Report(1, "east", "w-1", now - 1.0, now, demand, []))
            await svc.step()
            snap = svc.snapshot
            assert snap is not None
            assert float(np.max(snap.shed_fraction)) == 0.0
            snap.row(int(keys[0]))  # present
            try:
                snap.row(int(keys[1]))
            except KeyError:
                pass
            else:
                raise AssertionError("the P/D model has a table row")
        finally:
            svc.close()

    run(main())


def test_a_fleet_of_pd_engines_only_runs_without_rows(shm_name: str) -> None:
    """No colocated engine at all: zero rows, and a period still completes and publishes."""

    async def main() -> None:
        svc = ControllerService(config(shm_name, colocated=False))
        svc.open()
        try:
            assert svc.model.classes == ()
            await svc.step()
            assert svc.snapshot is not None and svc.snapshot.shed_fraction.size == 0
        finally:
            svc.close()

    run(main())
