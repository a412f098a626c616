"""Several controllers, one leading: the etcd election as the controller service sees it.

:class:`ControllerHa` runs a :class:`fastroute.etcd.Election` on ``controller.ha.election_key``
and answers the service's one question, :meth:`ControllerHa.leading` (asked right before every
publication); the leader's epoch goes into every table it publishes (``meta["epoch"]``), which
the proxies' intake fences on. Followers keep taking reports and closing derating and
profile-fit windows (a warm standby) and relay the reports to the leader, but neither solve
nor publish; ``GET /v1/table`` on a
follower redirects to the leader (docs/operations.md "Running several controllers").
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

from fastroute.config import ControllerHaConfig
from fastroute.etcd import Election, EtcdClient

__all__ = ["MAX_RELAYS", "RELAYED_HEADER", "ControllerHa"]

#: Bound on reports a follower relays to the leader at once (more are dropped and counted).
MAX_RELAYS = 64
#: Header on a relayed report, so a replica that is no longer leading never relays it again.
RELAYED_HEADER = "x-fastroute-relayed"


class ControllerHa:
    """The election of one controller replica.

    Parameters
    ----------
    config : ControllerHaConfig
        ``[controller.ha]`` with at least one ``etcd_urls`` entry.

    Attributes
    ----------
    election : Election or None
        None until :meth:`start` (the advertise URL is known once the socket listens).
    """

    def __init__(self, config: ControllerHaConfig) -> None:
        if not config.etcd_urls:
            raise ValueError("controller.ha.etcd_urls is empty: no election to run")
        self.config = config
        self.election: Election | None = None
        self._task: asyncio.Task[None] | None = None
        self._relay_session: aiohttp.ClientSession | None = None
        self._relays: set[asyncio.Task[None]] = set()
        #: Reports relayed to the leader, and those dropped (failed, or over the bound).
        self.relayed_total = 0
        self.relay_dropped_total = 0

    def start(self, advertise_url: str) -> None:
        """Campaign (in a task) with ``controller.ha.advertise_url``, else ``advertise_url``."""
        cfg = self.config
        client = EtcdClient(cfg.etcd_urls, timeout_s=cfg.etcd_timeout_s)
        url = cfg.advertise_url or advertise_url
        self.election = Election(client, cfg.election_key, url, cfg.lease_ttl_s)
        self._task = asyncio.create_task(self.election.run(), name="controller-election")

    def relay_report(self, body: bytes) -> None:
        """Forward a report a follower took to the leader (fire and forget, bounded).

        Proxies report to one controller (``proxy.controller_url``); the leader must see every
        proxy's demand, so followers relay. At most :data:`MAX_RELAYS` posts are in flight (a
        report is a period's window: dropping one under overload only thins the forecast), each
        bounded by ``etcd_timeout_s``.
        """
        leader = self.state_json()["leader"]
        if not isinstance(leader, str) or self.leading():
            return
        if len(self._relays) >= MAX_RELAYS:
            self.relay_dropped_total += 1
            return
        task = asyncio.create_task(self._relay(leader.rstrip("/") + "/v1/reports", body))
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)

    async def _relay(self, url: str, body: bytes) -> None:
        if self._relay_session is None:
            self._relay_session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.config.etcd_timeout_s)
        headers = {"Content-Type": "application/msgpack", RELAYED_HEADER: "1"}
        try:
            async with self._relay_session.post(
                url, data=body, headers=headers, timeout=timeout, allow_redirects=False
            ) as resp:
                ok = resp.status == 204
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok:
            self.relayed_total += 1
        else:
            self.relay_dropped_total += 1

    async def stop(self) -> None:
        """Resign (revoke the lease, so a follower leads at once) and close the etcd client."""
        for task in list(self._relays):
            task.cancel()
        if self._relay_session is not None:
            await self._relay_session.close()
            self._relay_session = None
        if self.election is None or self._task is None:
            return
        self.election.stop()
        # bounded: resigning tries each member once (len(etcd_urls) x etcd_timeout_s)
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(self._task, 5.0)
        await self.election.client.close()

    def leading(self) -> bool:
        """Whether this replica may publish now."""
        return self.election is not None and self.election.is_leader()

    @property
    def epoch(self) -> int | None:
        """This replica's epoch while it leads, else None."""
        return None if self.election is None else self.election.epoch

    def state_json(self) -> dict[str, Any]:
        """``role``, ``epoch`` (the leader's, as known) and ``leader`` (its URL, or None)."""
        if self.election is None:
            return {"role": "starting", "epoch": None, "leader": None}
        s = self.election.state
        return {"role": s.role, "epoch": s.epoch, "leader": s.leader_url}

    def plan_json(self) -> dict[str, Any]:
        """:meth:`state_json` plus the bounded leader history (most recent last)."""
        out = self.state_json()
        history = [] if self.election is None else list(self.election.history)
        out["history"] = [{"epoch": r.epoch, "url": r.url, "seen_at": r.seen_at_s} for r in history]
        out["terms_total"] = 0 if self.election is None else self.election.terms_total
        return out
