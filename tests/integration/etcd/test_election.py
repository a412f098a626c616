"""The etcd client and the election against a real 3-member etcd cluster on loopback (TTL 2 s)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from fastroute.etcd import Election, EtcdClient, EtcdError
from fastroute.testing.etcd import EtcdCluster

pytestmark = pytest.mark.integration

KEY = "/fastroute/test/leader"


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60.0))


async def _until(predicate: Any, bound_s: float) -> float:
    """Seconds until ``predicate()`` is true; fails after ``bound_s``."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not predicate():
        assert loop.time() - t0 < bound_s, f"condition not met within {bound_s} s"
        await asyncio.sleep(0.05)
    return loop.time() - t0


#: Lease TTL of the test that kills an etcd member. A leader keeps leading until its last
#: renewal's send + TTL - margin (TTL/4), and that renewal may be one interval (TTL/3) old when
#: the member dies: it rides out an etcd stall of TTL * 5/12 at least. Killing the etcd leader
#: stalls every call for its election (timeout 500-1000 ms here, longer on a loaded 2-core CI
#: machine: one run stalled past the 0.83 s a 2 s TTL leaves), so 6 s leaves 2.5 s.
MEMBER_LOSS_TTL_S = 6


def _candidates(cluster: EtcdCluster, n: int, ttl_s: int = 2) -> list[Election]:
    return [
        Election(EtcdClient(cluster.client_urls, timeout_s=0.4), KEY, f"http://c{i}", ttl_s=ttl_s)
        for i in range(n)
    ]


def test_client_round_trip_and_failover(etcd_cluster: EtcdCluster) -> None:
    async def go() -> None:
        # the first URL is dead: every call still lands on a live member
        client = EtcdClient(["http://127.0.0.1:1", *etcd_cluster.client_urls], timeout_s=0.5)
        try:
            await client.put("/k", "v1")
            kv = await client.get("/k")
            assert kv is not None and kv.value == "v1"
            lease = await client.grant(2)
            created, first = await client.create("/e", "a", lease)
            assert created and first is not None
            created, again = await client.create("/e", "b", lease)
            assert not created and again is not None
            assert again.value == "a" and again.create_revision == first.create_revision
            assert await client.keepalive(lease) > 0
            await client.revoke(lease)
            assert await client.get("/e") is None
            await client.delete("/k")
            assert await client.get("/k") is None
        finally:
            await client.close()

    run(go())


def test_client_all_endpoints_down_names_each() -> None:
    async def go() -> None:
        client = EtcdClient(["http://127.0.0.1:1", "http://127.0.0.1:2"], timeout_s=0.3)
        try:
            with pytest.raises(EtcdError, match=r"127\.0\.0\.1:1.*127\.0\.0\.1:2"):
                await client.get("/k")
        finally:
            await client.close()

    run(go())


def test_bad_urls_are_refused() -> None:
    with pytest.raises(EtcdError, match="http://"):
        EtcdClient(["127.0.0.1:2379"])
    with pytest.raises(EtcdError, match="no etcd URL"):
        EtcdClient([" "])


def test_exactly_one_leader_then_failover_raises_epoch(etcd_cluster: EtcdCluster) -> None:
    async def go() -> None:
        cands = _candidates(etcd_cluster, 3)
        tasks = [asyncio.create_task(c.run()) for c in cands]
        try:
            await _until(lambda: sum(c.is_leader() for c in cands) == 1, 10.0)
            for _ in range(20):  # stays exactly one over several renewals
                assert sum(c.is_leader() for c in cands) == 1
                await asyncio.sleep(0.1)
            leader = next(c for c in cands if c.is_leader())
            first_epoch = leader.epoch
            assert first_epoch is not None
            followers = [c for c in cands if c is not leader]
            await _until(
                lambda: all(f.state.leader_url == leader.advertise_url for f in followers), 5.0
            )
            # the leader's process dies without resigning: tasks cancelled, lease not revoked
            i = cands.index(leader)
            tasks[i].cancel()
            leader._lease = None  # what a SIGKILL leaves: nobody renews the lease
            await _until(lambda: any(f.is_leader() for f in followers), 2.0 * 2 + 3.0)
            new = next(f for f in followers if f.is_leader())
            assert new.epoch is not None and new.epoch > first_epoch
            assert sum(f.is_leader() for f in followers) == 1
        finally:
            for c in cands:
                c.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in cands:
                await c.client.close()

    run(go())


def test_one_member_killed_keeps_the_leader(etcd_cluster: EtcdCluster) -> None:
    async def go() -> None:
        cands = _candidates(etcd_cluster, 2, ttl_s=MEMBER_LOSS_TTL_S)
        tasks = [asyncio.create_task(c.run()) for c in cands]
        try:
            await _until(lambda: sum(c.is_leader() for c in cands) == 1, 10.0)
            leader = next(c for c in cands if c.is_leader())
            epoch = leader.epoch
            etcd_cluster.kill(0)  # the member every client tries first
            # one TTL: past it the lease would be gone had the surviving members not kept it
            for _ in range(MEMBER_LOSS_TTL_S * 10):
                assert leader.is_leader() and leader.epoch == epoch
                assert sum(c.is_leader() for c in cands) == 1
                await asyncio.sleep(0.1)
        finally:
            for c in cands:
                c.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in cands:
                await c.client.close()

    run(go())


def test_all_members_gone_leader_steps_down_before_ttl(etcd_cluster: EtcdCluster) -> None:
    async def go() -> None:
        (cand,) = _candidates(etcd_cluster, 1)
        task = asyncio.create_task(cand.run())
        try:
            await _until(cand.is_leader, 10.0)
            await asyncio.sleep(0.8)  # a renewal or two
            loop = asyncio.get_running_loop()
            etcd_cluster.stop()
            t_stop = loop.time()
            await _until(lambda: not cand.is_leader(), 3.0)
            # stepped down within TTL of the outage (the lease may live TTL after the last renewal)
            assert loop.time() - t_stop <= 2.0
            assert cand.state.role != "leader"
            await _until(lambda: cand.state.role == "unknown", 2.0)  # once the lease may be gone
        finally:
            cand.stop()
            await asyncio.gather(task, return_exceptions=True)
            await cand.client.close()

    run(go())


def test_leader_returns_after_an_outage_longer_than_the_ttl(etcd_cluster: EtcdCluster) -> None:
    """Every member down for 2.5 × TTL, then back: etcd extends the leases it finds, so the
    former leader's key survives under its lease; it must lead again (it did not: every
    candidate followed that key forever)."""

    async def go() -> None:
        cands = _candidates(etcd_cluster, 2)
        tasks = [asyncio.create_task(c.run()) for c in cands]
        try:
            await _until(lambda: sum(c.is_leader() for c in cands) == 1, 10.0)
            (first,) = [c for c in cands if c.is_leader()]
            epoch = first.epoch
            etcd_cluster.stop()
            await _until(lambda: not any(c.is_leader() for c in cands), 3.0)
            await asyncio.sleep(5.0)
            etcd_cluster.start()
            await _until(lambda: any(c.is_leader() for c in cands), 20.0)
            leaders = [c for c in cands if c.is_leader()]
            assert len(leaders) == 1
            assert leaders[0].epoch is not None and epoch is not None
            assert leaders[0].epoch >= epoch
            for _ in range(20):  # and it stays one leader
                assert sum(c.is_leader() for c in cands) == 1
                await asyncio.sleep(0.1)
        finally:
            for c in cands:
                c.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in cands:
                await c.client.close()

    run(go())
