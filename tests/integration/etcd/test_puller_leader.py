"""The weights puller finds the leading controller through a real etcd, and follows it when it
moves; without etcd it falls back to the controller URLs. Controllers are small aiohttp stubs
(the table's long-poll contract; a follower that answers 307 to the leader)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from fastroute.etcd import EtcdClient
from fastroute.proxy.background.leader_lookup import EtcdLeader
from fastroute.proxy.background.puller import WeightsPuller
from fastroute.tables import TableSnapshot
from fastroute.tables.wire import encode_snapshot
from fastroute.testing.etcd import EtcdCluster
from fastroute.testing.processes import free_port

pytestmark = pytest.mark.integration

KEY = "/fastroute/test/puller-leader"


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60.0))


async def _until(predicate: Any, bound_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not predicate():
        assert loop.time() - t0 < bound_s, f"condition not met within {bound_s} s"
        await asyncio.sleep(0.02)


class Stub:
    """A controller: serves ``snap`` (an epoch-stamped table), or redirects to ``leader``."""

    def __init__(self, epoch: int, leader: str | None = None) -> None:
        self.snap = TableSnapshot.validated(
            3, [11, 12], np.array([[1.0, 2.0]]), published_at=time.time(), meta={"epoch": epoch}
        )
        self.leader = leader
        self.polls = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def table(self, request: web.Request) -> web.StreamResponse:
        self.polls += 1
        if self.leader is not None:
            raise web.HTTPTemporaryRedirect(self.leader + request.path_qs)
        same = request.query.get("after") == "3" and request.query.get("epoch") == str(
            self.snap.meta["epoch"]
        )
        if same:  # the long poll: nothing newer
            await asyncio.sleep(float(request.query.get("timeout_s", "1")))
            return web.Response(status=304)
        return web.Response(body=encode_snapshot(self.snap), content_type="application/msgpack")

    async def start(self) -> Stub:
        app = web.Application()
        app.router.add_get("/v1/table", self.table)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@contextlib.asynccontextmanager
async def _running(puller: WeightsPuller) -> AsyncIterator[None]:
    task = asyncio.create_task(puller.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _puller(url: str, name: str, leader: EtcdLeader | None, **kw: Any) -> WeightsPuller:
    kw = {"poll_timeout_s": 1.0, "backoff_initial_s": 0.05, "backoff_max_s": 0.4, **kw}
    return WeightsPuller(url, name, leader=leader, **kw)


def test_the_puller_reads_the_leader_from_etcd_and_follows_it_when_it_moves(
    etcd_cluster: EtcdCluster, shm_name: str
) -> None:
    async def main() -> None:
        etcd = EtcdClient(etcd_cluster.client_urls, timeout_s=0.5)
        first, second = await Stub(epoch=20).start(), await Stub(epoch=30).start()
        follower = await Stub(epoch=0, leader=first.url).start()  # the static URL: a follower
        try:
            await etcd.put(KEY, first.url)
            leader = EtcdLeader(tuple(etcd_cluster.client_urls), KEY, 0.5)
            puller = _puller(follower.url, shm_name, leader)
            async with _running(puller):
                await _until(lambda: puller.epoch == 20)
                assert follower.polls == 0  # etcd named the leader before the first poll
                assert puller.url == first.url + "/v1/table"
                await first.stop()  # the leader dies; another is elected and writes the key
                await etcd.delete(KEY)
                await etcd.put(KEY, second.url)
                await _until(lambda: puller.epoch == 30)
                assert puller.url == second.url + "/v1/table"
                assert leader.lookups_total >= 2 and puller.errors_total.get("connect", 0) >= 1
        finally:
            for stub in (first, second, follower):
                await stub.stop()
            await etcd.close()

    run(main())


def test_without_etcd_the_puller_uses_the_controller_urls_and_follows_a_redirect(
    shm_name: str,
) -> None:
    async def main() -> None:
        leader_stub = await Stub(epoch=7).start()
        follower = await Stub(epoch=0, leader=leader_stub.url).start()
        try:
            dead_etcd = EtcdLeader((f"http://127.0.0.1:{free_port()}",), KEY, 0.2)
            puller = _puller(follower.url, shm_name, dead_etcd)
            async with _running(puller):
                await _until(lambda: puller.epoch == 7)
                assert dead_etcd.errors_total >= 1 and follower.polls >= 1
                # the follower's 307 was followed by hand: the puller now asks the leader
                assert puller.url == leader_stub.url + "/v1/table"
                polls = follower.polls
                await _until(lambda: leader_stub.polls >= 3)  # long polls, straight to it
                assert follower.polls == polls
        finally:
            await follower.stop()
            await leader_stub.stop()

    run(main())
