"""Per-region tables on loopback: ``GET /v1/table?cluster=`` and a proxy's puller asking for it.

The controller app runs in-process over the shared two-region fleet (east: engine-0, engine-1;
west: engine-2, engine-3; RTT 80 ms; low default demand, so each region's rows stay on its own
engines). The puller is the proxy's :class:`WeightsPuller` writing its own table.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from controller_fleet import MODEL, two_region_toml

from controller.app import API, SERVICE, make_app
from controller.service import ControllerService
from fastroute.config import PRIORITIES, decode_config
from fastroute.hashing import class_key, engine_id
from fastroute.proxy.background.puller import WeightsPuller
from fastroute.proxy.path.fleet import Fleet
from fastroute.tables import TableReader, TableSnapshot
from fastroute.tables.wire import decode_snapshot
from fastroute.testing.servers import serve_app
from fastroute.testing.waiting import wait_until

pytestmark = pytest.mark.integration


def run(coro: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def config_toml(table_name: str, cluster: str = "east") -> str:
    toml = two_region_toml(table_name, controller="long_poll_timeout_s = 2.0\n")
    return toml.replace('cluster = "east"', f'cluster = "{cluster}"')


@contextlib.asynccontextmanager
async def controller(
    table_name: str,
) -> AsyncIterator[tuple[ControllerService, str, web.Application]]:
    app = make_app(decode_config(config_toml(table_name), source="controller.toml"))
    async with serve_app(app) as url:
        yield app[SERVICE], url, app


def keys(region: str) -> list[int]:
    return [class_key(region, MODEL, p) for p in PRIORITIES]


def local(name: str) -> TableSnapshot:
    reader = TableReader(name)
    try:
        return reader.snapshot()
    finally:
        reader.close()


def test_table_endpoint_serves_a_regions_rows(shm_name: str) -> None:
    """``cluster=east``: east's rows over east's engines, same generation and meta, in both
    encodings, each encoded once; without ``cluster`` the full table; an unknown cluster is
    404 naming the declared regions, at once (not parked) even when the poll would park."""

    async def main() -> None:
        async with controller(shm_name) as (svc, url, app), aiohttp.ClientSession() as s:
            await wait_until(lambda: svc.periods_total >= 3)  # steady: no new generations
            gen, full = svc.generation, svc.snapshot
            assert full is not None and full.n_classes == 6
            api = app[API]
            before = api.tables.encodes_total
            for _ in range(2):
                q = {"after": "0", "cluster": "east"}
                async with s.get(url + "/v1/table", params=q) as resp:
                    assert resp.status == 200 and resp.content_type == "application/msgpack"
                    assert resp.headers["x-fastroute-generation"] == str(gen)
                    east = decode_snapshot(await resp.read())
            assert api.tables.encodes_total == before + 1
            assert east.class_keys.tolist() == keys("east")
            assert east.engine_ids.tolist() == [engine_id(f"engine-{i}") for i in (0, 1)]
            assert east.generation == gen and east.published_at == full.published_at
            assert east.meta == full.meta and east.meta["plan_id"] >= 1
            np.testing.assert_allclose(east.weights.sum(axis=1), 1.0)
            for row, key in enumerate(keys("east")):
                np.testing.assert_array_equal(east.weights[row], full.weights[full.row(key)][:2])
            q = {"after": "0", "cluster": "west", "format": "json"}
            async with s.get(url + "/v1/table", params=q) as resp:
                assert resp.status == 200 and resp.content_type == "application/json"
                west = decode_snapshot(await resp.read())
            assert west.class_keys.tolist() == keys("west")
            assert west.meta == full.meta
            async with s.get(url + "/v1/table", params={"after": "0"}) as resp:
                assert decode_snapshot(await resp.read()).n_classes == 6  # the full table
            q = {"after": str(gen), "timeout_s": "30", "cluster": "mars"}
            async with s.get(url + "/v1/table", params=q) as resp:
                assert resp.status == 404
                text = await resp.text()
            assert "'mars'" in text and "east, west" in text and api.waiters == 0
            q = {"after": str(gen), "timeout_s": "0.3", "cluster": "west"}
            async with s.get(url + "/v1/table", params=q) as resp:
                assert resp.status == 304  # long-poll works per region as for the full table

    run(main())


def test_puller_with_its_cluster_gets_only_its_rows(shm_name: str, proxy_table: str) -> None:
    """A west proxy's puller writes west's rows only into its table; the controller's own table
    stays whole; the west proxy's fleet state from it equals the one from the full table."""

    async def main() -> None:
        async with controller(shm_name) as (svc, url, _):
            await wait_until(lambda: svc.periods_total >= 3)
            puller = WeightsPuller(url, proxy_table, poll_timeout_s=0.5, cluster="west")
            task = asyncio.create_task(puller.run())
            try:
                await wait_until(lambda: puller.controller_generation == svc.generation > 0)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            assert puller.errors_total == {}
            return svc.snapshot

    full = run(main())
    pulled = local(proxy_table)
    assert pulled.class_keys.tolist() == keys("west")
    assert pulled.engine_ids.tolist() == [engine_id(f"engine-{i}") for i in (2, 3)]
    assert local(shm_name).n_classes == 2 * len(PRIORITIES) == full.n_classes
    fleet = Fleet(decode_config(config_toml(proxy_table, "west"), source="proxy.toml"))
    a, b = fleet.state_from_snapshot(full), fleet.state_from_snapshot(pulled)
    for field in ("weights", "positive", "available", "shed_fraction"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert a.weights[:, 2:].sum() == pytest.approx(len(a.weights))  # west rows: west engines
