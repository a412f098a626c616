"""Several controllers, one leading: the etcd election as the controller service sees it.

:class:`ControllerHa` runs a :class:`fastroute.etcd.Election` on ``controller.ha.election_key``
and answers the service's one question, :meth:`ControllerHa.leading` (asked right before every
publication); the leader's epoch goes into every table it publishes (``meta["epoch"]``), which
the proxies' intake fences on. Followers keep taking reports and closing derating and
profile-fit windows (a warm standby) but neither solve nor publish; ``GET /v1/table`` on a
follower redirects to the leader (docs/operations.md "Running several controllers").
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastroute.config import ControllerHaConfig
from fastroute.etcd import Election, EtcdClient

__all__ = ["ControllerHa"]


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

    def start(self, advertise_url: str) -> None:
        """Campaign (in a task) with ``controller.ha.advertise_url``, else ``advertise_url``."""
        cfg = self.config
        client = EtcdClient(cfg.etcd_urls, timeout_s=cfg.etcd_timeout_s)
        url = cfg.advertise_url or advertise_url
        self.election = Election(client, cfg.election_key, url, cfg.lease_ttl_s)
        self._task = asyncio.create_task(self.election.run(), name="controller-election")

    async def stop(self) -> None:
        """Resign (revoke the lease, so a follower leads at once) and close the etcd client."""
        if self.election is None or self._task is None:
            return
        self.election.stop()
        with contextlib.suppress(asyncio.CancelledError):
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
