"""Derating end to end: synthetic proxy reports over HTTP → health levels → weights, flags, plan.

The controller app runs in-process (``web.AppRunner`` on 127.0.0.1:0, ``run_loop=False``) over
four h100 engines (east: engine-0, engine-1; west: engine-2, engine-3), and the test drives the
periods itself with :meth:`ControllerService.step`, so nothing depends on wall-clock timing. The
engines are never contacted: the signal is the reports POSTed to ``/v1/reports``, every engine at
ρ = 0.5 (5 req/s of 10) with TTFT equal to its profile, except where the test slows one down.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import aiohttp
import numpy as np
import pytest
from controller_fleet import ENGINES, FAST_DERATING, two_region_toml

from controller.app import SERVICE, make_app
from controller.service import ControllerService
from fastroute.config import decode_config
from fastroute.hashing import engine_id
from fastroute.signals.reports import (
    EngineReport,
    LatencySummary,
    Report,
    encode_report,
)
from fastroute.tables import FLAG_UNAVAILABLE, TableReader
from fastroute.testing.servers import serve_app

pytestmark = pytest.mark.integration

WINDOW_S = 5.0
ATTEMPTS = 25  # per window: 5 req/s on 10 req/s engines, ρ = 0.5
PROFILE_TTFT_S = 0.05 / (1 - 0.5)  # h100 seed profile at ρ = 0.5
EAST_DEFAULT = "east/demo-8b/default"


def run(coro: Coroutine[Any, Any, Any], timeout: float = 25.0) -> Any:
    """Run ``coro`` on a fresh loop under a hard timeout."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def controller(table_name: str) -> AsyncIterator[tuple[ControllerService, str]]:
    config = decode_config(two_region_toml(table_name, tables=FAST_DERATING), "controller.toml")
    app = make_app(config, run_loop=False)
    async with serve_app(app) as url:
        yield app[SERVICE], url


def report(
    ttft_factor: dict[str, float] | None = None, errors: dict[str, int] | None = None
) -> bytes:
    """One worker's window: every engine at ρ = 0.5, TTFT = profile × factor, errors as given."""
    now = time.time()
    engines = []
    for name in ENGINES:
        mean_s = PROFILE_TTFT_S * (ttft_factor or {}).get(name, 1.0)
        ttft = LatencySummary(ATTEMPTS, ATTEMPTS * mean_s, mean_s, mean_s, mean_s, mean_s, [])
        n_err = (errors or {}).get(name, 0)
        failures = {"http_5xx": n_err} if n_err else {}
        engines.append(EngineReport(engine_id(name), ATTEMPTS, failures, ttft))
    return encode_report(Report(1, "east", "w-1", now - WINDOW_S, now, [], engines))


async def period(
    svc: ControllerService, s: aiohttp.ClientSession, url: str, body: bytes
) -> dict[str, Any]:
    """POST one report, run one period, return ``/v1/plan``."""
    async with s.post(url + "/v1/reports", data=body) as r:
        assert r.status == 204
    await svc.step()
    async with s.get(url + "/v1/plan") as r:
        assert r.status == 200
        return dict(await r.json())


def engine(plan: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in plan["engines"] if e["name"] == name)


def east_weights(plan: dict[str, Any]) -> dict[str, float]:
    return dict(next(c for c in plan["classes"] if c["name"] == EAST_DEFAULT)["weights"])


def test_slow_engine_is_derated_after_3_periods_and_restored_after_6(shm_name: str) -> None:
    """TTFT 3× its peers: h stays 1 for 2 periods, .75 from the 3rd (weight falls, reason in
    /v1/plan, metric); healthy reports hold .75 for 5 periods and restore 1 at the 6th."""

    async def main() -> None:
        async with controller(shm_name) as (svc, url), aiohttp.ClientSession() as s:
            plan = await period(svc, s, url, report())
            w0 = east_weights(plan)
            assert w0["engine-0"] == pytest.approx(w0["engine-1"])
            assert engine(plan, "engine-0")["derating"]["level"] == 1.0

            levels = []
            for _ in range(3):
                plan = await period(svc, s, url, report({"engine-0": 3.0}))
                levels.append(engine(plan, "engine-0")["derating"]["level"])
            assert levels == [1.0, 1.0, 0.75]
            e0 = engine(plan, "engine-0")
            assert e0["health_level"] == 0.75 and e0["effective_capacity_rps"] == 7.5
            reason = e0["derating"]["reason"]
            assert reason.startswith("TTFT 3.0× profile at ρ=0.50, z=") and "3 windows" in reason
            assert e0["derating"]["since"] is not None and e0["health_reason"] == reason
            assert not e0["unavailable"] and engine(plan, "engine-0")["group"] == 0
            w1 = east_weights(plan)
            assert w1["engine-0"] < w0["engine-0"]
            assert w1["engine-0"] / w1["engine-1"] == pytest.approx(0.75)
            for other in ENGINES[1:]:
                assert engine(plan, other)["derating"]["level"] == 1.0
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            assert 'fastroute_controller_engine_health{engine="engine-0"} 0.75' in text

            levels = []
            for _ in range(6):
                plan = await period(svc, s, url, report())
                levels.append(engine(plan, "engine-0")["derating"]["level"])
            assert levels == [0.75] * 5 + [1.0]
            assert engine(plan, "engine-0")["derating"]["reason"].startswith(
                "healthy for 6 windows"
            )
            w2 = east_weights(plan)
            assert w2["engine-0"] == pytest.approx(w2["engine-1"])

    run(main())


def test_error_rate_walks_an_engine_to_zero_and_flags_it_unavailable(shm_name: str) -> None:
    """40 % 5xx on engine-2: one level per 3 periods down to 0, then FLAG_UNAVAILABLE and no
    weight in the local table; its peers (25 % cap of the 4 h100) are never derated."""

    async def main() -> None:
        async with controller(shm_name) as (svc, url), aiohttp.ClientSession() as s:
            levels = []
            for _ in range(15):
                plan = await period(svc, s, url, report(errors={"engine-2": 10}))
                levels.append(engine(plan, "engine-2")["derating"]["level"])
            assert levels[2::3] == [0.75, 0.5, 0.25, 0.0, 0.0]
            e2 = engine(plan, "engine-2")
            assert e2["unavailable"] and "error rate" in e2["derating"]["reason"]
            reader = TableReader(shm_name)
            try:
                snap = reader.snapshot()
            finally:
                reader.close()
            col = int(np.flatnonzero(snap.engine_ids == engine_id("engine-2"))[0])
            assert snap.engine_flags[col] == FLAG_UNAVAILABLE
            assert not snap.weights[:, col].any()
            np.testing.assert_allclose(snap.weights.sum(axis=1), 1.0)
            assert [engine(plan, n)["derating"]["level"] for n in ENGINES] == [1, 1, 0, 1]

    run(main())
