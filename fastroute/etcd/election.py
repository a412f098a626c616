"""Leader election on one etcd key bound to a lease, with the epoch to fence on.

Every candidate holds a lease of ``ttl_s`` seconds and renews it every ``ttl_s / 3``; a candidate
that is not leading tries to *create* the election key (a transaction: only if the key does not
exist) with its advertise URL as value, under its lease. The one that creates it leads; the key's
create revision is its **epoch**: etcd revisions only grow, so a later leader always has a higher
epoch, and a table stamped with it can be fenced by the proxies.

The leader keeps leading only while its lease is surely alive: until the send time of the last
successful renewal plus ``ttl_s`` minus ``margin_s`` (:meth:`Election.is_leader` reads the clock
at every question, not at loop ticks). etcd keeps the lease at least ``ttl_s`` after that renewal
reached it, so the leader stops ``margin_s`` before a successor could win.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastroute.etcd.client import EtcdClient, EtcdError

__all__ = ["Election", "ElectionState", "LeaderRecord"]

log = logging.getLogger(__name__)

#: Bound of the leader history kept for the plan page (most recent last).
HISTORY_MAX = 32


@dataclass(frozen=True, slots=True)
class LeaderRecord:
    """One leader seen: its epoch, URL and when this candidate first saw it (Unix seconds)."""

    epoch: int
    url: str
    seen_at_s: float


@dataclass(frozen=True, slots=True)
class ElectionState:
    """What :attr:`Election.state` reports: role, the epoch in force and the leader's URL."""

    role: str
    epoch: int | None
    leader_url: str | None


class Election:
    """One candidate of the election on ``key``.

    Parameters
    ----------
    client : EtcdClient
    key : str
        The election key (e.g. ``/fastroute/controller/leader``).
    advertise_url : str
        This candidate's URL, the key's value while it leads (proxies and followers read it).
    ttl_s : int
        Lease TTL, seconds (>= 1; etcd's lease granularity is one second).
    margin_s : float, optional
        How long before the lease could expire the leader stops leading; default ``ttl_s / 4``
        (one renewal interval minus a little, so one late renewal is absorbed, two are not).
    clock : callable
        Monotonic seconds (default ``time.monotonic``).
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        advertise_url: str,
        ttl_s: int,
        margin_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"lease ttl_s must be >= 1 s, got {ttl_s}")
        self.client = client
        self.key = key
        self.advertise_url = advertise_url
        self.ttl_s = int(ttl_s)
        self.margin_s = self.ttl_s / 4 if margin_s is None else margin_s
        self.clock = clock
        self.interval_s = self.ttl_s / 3
        #: Pause after a failed call, and a follower's campaign interval: a tenth of the TTL,
        #: so a lease whose renewal failed gets several more tries before its margin, and a
        #: dead leader's key is taken within TTL/10 of its going (at most 10 calls per TTL).
        self.retry_s = self.ttl_s / 10
        self.history: collections.deque[LeaderRecord] = collections.deque(maxlen=HISTORY_MAX)
        self.errors_total = 0
        self.terms_total = 0
        self._lease: int | None = None
        self._lease_valid_until = 0.0
        self._leading_epoch: int | None = None
        self._seen_epoch: int | None = None
        self._seen_url: str | None = None
        self._stop = asyncio.Event()
        self._last_error: str | None = None

    # -- questions ---------------------------------------------------------------------------

    def is_leader(self) -> bool:
        """Whether this candidate leads now (its lease surely alive for ``margin_s`` more)."""
        if self._leading_epoch is None:
            return False
        if self.clock() < self._lease_valid_until - self.margin_s:
            return True
        self._step_down("lease renewal overdue")
        return False

    @property
    def epoch(self) -> int | None:
        """This candidate's epoch while it leads, else None."""
        return self._leading_epoch if self.is_leader() else None

    @property
    def state(self) -> ElectionState:
        """Role (``leader``, ``follower``, or ``unknown`` when etcd is unreachable) and leader."""
        if self.is_leader():
            return ElectionState("leader", self._leading_epoch, self.advertise_url)
        alive = self._lease is not None and self.clock() < self._lease_valid_until
        role = "follower" if alive else "unknown"
        return ElectionState(role, self._seen_epoch, self._seen_url)

    # -- the task ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to return (it then resigns)."""
        self._stop.set()

    async def run(self) -> None:
        """Renew the lease every ``ttl_s / 3`` while leading; while following (and after a
        failed call) renew and campaign every ``ttl_s / 10``; until :meth:`stop`, then resign."""
        try:
            while not self._stop.is_set():
                # A follower campaigns every retry_s: the leader's key goes when etcd revokes
                # its lease (checked every 500 ms by etcd's lessor), and every TTL/3 of delay
                # here would add to the failover on top of TTL and that check.
                wait_s = self.interval_s if self._leading_epoch is not None else self.retry_s
                try:
                    await self.tick()
                except EtcdError as exc:
                    self._record_error(exc)
                    # Retry soon: an etcd leader change (one member lost) stalls calls for
                    # about its election timeout, and a renewal one full interval later
                    # could fall past the lease's margin and depose a healthy leader.
                    wait_s = self.retry_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), wait_s)
        finally:
            await self.resign()

    async def tick(self) -> None:
        """One renewal (granting a lease if none), then, when not leading, one campaign try."""
        sent_at = self.clock()
        if self._lease is None:
            self._lease = await self.client.grant(self.ttl_s)
        else:
            ttl = await self._renew()
            if ttl <= 0:
                self._lease = None
                self._step_down("lease expired")
                return
        self._lease_valid_until = sent_at + self.ttl_s
        self._last_error = None
        if self._leading_epoch is None:
            await self._campaign()

    async def _renew(self) -> int:
        assert self._lease is not None
        try:
            return await self.client.keepalive(self._lease)
        except EtcdError:
            self.is_leader()  # steps down if the lease may be gone
            raise

    async def _campaign(self) -> None:
        assert self._lease is not None
        created, kv = await self.client.create(self.key, self.advertise_url, self._lease)
        if kv is None:
            return
        self._observe(kv.create_revision, kv.value)
        # The key under this candidate's own lease: it stepped down (a renewal was overdue,
        # etcd unreachable) but the lease survived — etcd extends every lease when its
        # cluster comes back — so its key stayed and no one else can have led since. Lead
        # again on that epoch; otherwise every candidate would follow a key nobody serves
        # until this lease lapses, which it never does while we renew it.
        if created or kv.lease == self._lease:
            self._leading_epoch = kv.create_revision
            self.terms_total += 1
            log.warning("leading the controllers: epoch %d (%s)", kv.create_revision, self.key)

    async def resign(self) -> None:
        """Give the lead up at once (revoke the lease: the key goes, a follower leads next)."""
        lease, self._lease = self._lease, None
        self._step_down("resigned")
        if lease is not None:
            with contextlib.suppress(EtcdError):
                await self.client.revoke(lease)

    # -- internals ---------------------------------------------------------------------------

    def _observe(self, epoch: int, url: str) -> None:
        if epoch != self._seen_epoch:
            self.history.append(LeaderRecord(epoch, url, time.time()))
            if self._leading_epoch is None:
                log.info("controller leader is %s (epoch %d)", url, epoch)
        self._seen_epoch, self._seen_url = epoch, url

    def _step_down(self, why: str) -> None:
        if self._leading_epoch is not None:
            log.warning("stepping down from epoch %d: %s", self._leading_epoch, why)
            self._leading_epoch = None
            self._seen_url = None

    def _record_error(self, exc: EtcdError) -> None:
        self.errors_total += 1
        text = str(exc)
        if text != self._last_error:
            log.error("etcd: %s", text)
        self._last_error = text
