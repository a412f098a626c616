"""The leading controller's URL, read from etcd (``proxy.etcd_urls``, ``proxy.leader_key``).

The leader writes its ``advertise_url`` at the election key under its lease
(:mod:`fastroute.etcd.election`), so the key exists exactly while a leader holds it, and its create
revision is the leader's epoch. :class:`EtcdLeader` reads it with one bounded range call
(:class:`~fastroute.etcd.client.EtcdClient`, each member tried in turn); the weights puller asks
before its first poll and again at once after any failed poll.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastroute.etcd.client import EtcdClient, EtcdError

__all__ = ["EtcdLeader", "Leader"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Leader:
    """The leader named by the key: its URL and epoch (the key's create revision)."""

    url: str
    epoch: int


class EtcdLeader:
    """Read the leader key from etcd.

    Parameters
    ----------
    urls : sequence of str
        etcd client URLs.
    key : str
        The election key.
    timeout_s : float
        Timeout of one read on one member, seconds.

    Attributes
    ----------
    lookups_total, errors_total : int
        Reads made, and reads no member answered.
    last : Leader or None
        The leader of the last successful read (None: none yet, or the key was absent).
    """

    def __init__(self, urls: tuple[str, ...], key: str, timeout_s: float) -> None:
        self.client = EtcdClient(urls, timeout_s=timeout_s)
        self.key = key
        self.lookups_total = 0
        self.errors_total = 0
        self.last: Leader | None = None
        self._last_error: str | None = None

    async def lookup(self) -> Leader | None:
        """The leader now; None when etcd does not answer or names no leader (logged once)."""
        self.lookups_total += 1
        try:
            kv = await self.client.get(self.key)
        except EtcdError as exc:
            self.errors_total += 1
            if str(exc) != self._last_error:
                logger.warning("leader lookup in etcd failed, using the controller URLs: %s", exc)
                self._last_error = str(exc)
            return None
        self._last_error = None
        if kv is None or not kv.value.startswith(("http://", "https://")):
            self.last = None
            return None
        leader = Leader(kv.value.rstrip("/"), kv.create_revision)
        if leader != self.last:
            logger.info("etcd names leader %s (epoch %d)", leader.url, leader.epoch)
        self.last = leader
        return leader

    async def close(self) -> None:
        """Close the etcd client's HTTP session."""
        await self.client.close()
