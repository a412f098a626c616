"""Pull weight tables from a remote controller into the local shared-memory table.

:class:`WeightsPuller` long-polls ``{controller_url}/v1/table?after=<gen>&timeout_s=<t>``
(the contract is in ``docs/signals.md``), with ``&cluster=<proxy.cluster>`` when given so the
controller sends only this region's rows (docs/controller.md, "API"), decodes the snapshot
(:func:`fastroute.tables.wire.decode_snapshot`) and publishes it into the local
table ``proxy.table_name`` with a :class:`~fastroute.tables.TableWriter`; every
worker's :class:`~fastroute.proxy.background.table_watch.TableWatcher` then adopts it as if the
controller were local.

* Routing never waits on it: it is a background task, and decoding and publishing
  run in a worker thread.
* Any error (connect, timeout, HTTP status, bad payload, table refusal) keeps the
  last good table, is counted by kind and logged once per distinct message, and
  the next poll waits an exponential backoff with jitter (bounded by
  ``backoff_max_s``).
* Finding the leader (docs/operations.md "Running several controllers"): with an
  :class:`~fastroute.proxy.background.leader_lookup.EtcdLeader`, the URL etcd's leader key names,
  read before the first poll and after every failed one; else (etcd down, no leader named, or
  it names the URL that just failed) ``controller_url`` and ``controller_fallback_urls`` in
  turn. A follower's 307 is followed by hand (one hop) and its leader kept as the URL.
* Catch-up after a failover: after a connection error, timeout, 503 or fenced table, the next
  URL is tried at once, for one round of the URLs (:meth:`WeightsPuller.round_size`); after
  that, while some controller answered (a 503 "no leader known", a redirect, a fenced table: an
  election is under way), the wait is at most ``failover_backoff_max_s``
  (:data:`FAILOVER_BACKOFF_MAX_S`); only while nothing answers does it grow to
  ``backoff_max_s``.
* One puller per host: the table's writer lock decides. A worker that finds the
  lock taken (:class:`~fastroute.errors.TableLockedError`: another worker pulls, or
  the controller runs on this host) stands by and retries the lock every
  ``lock_retry_s``, so a dead puller's place is taken over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from urllib.parse import urljoin

import aiohttp

from fastroute.errors import TableError, TableFencedError, TableLockedError
from fastroute.proxy.background.leader_lookup import EtcdLeader
from fastroute.signals.body import read_bounded
from fastroute.tables import TableWriter
from fastroute.tables.stale import describe
from fastroute.tables.wire import (
    MSGPACK_CONTENT_TYPE,
    WireError,
    decode_snapshot,
    publish_snapshot,
)

__all__ = ["WeightsPuller", "PullError", "MAX_SNAPSHOT_BYTES", "FAILOVER_BACKOFF_MAX_S"]

logger = logging.getLogger(__name__)

#: Largest snapshot body accepted (a 1024 x 4096 table is 32 MiB of weights).
MAX_SNAPSHOT_BYTES = 256 * 1024 * 1024
#: Longest wait between polls while some controller answers but none serves a table (an
#: election under way): a new leader's first table is applied at most this late, plus a poll.
FAILOVER_BACKOFF_MAX_S = 0.5
#: Error kinds that say "ask another controller": the next URL is tried.
_ROTATE_KINDS = frozenset({"connect", "timeout", "http", "fenced"})
#: HTTP statuses of a live controller that does not serve the table (a follower knowing no
#: leader answers 503): a short backoff, the leader is being elected.
_ALIVE_STATUSES = frozenset({503})


class PullError(Exception):
    """One poll failed; ``kind`` names how (``http``, ``too_large``)."""

    def __init__(self, kind: str, message: str, *, alive: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        #: The controller answered (it is up; an election may be under way).
        self.alive = alive


class _Redirect(Exception):
    """A follower's 307: ``url`` is the leader's ``/v1/table``."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url


class WeightsPuller:
    """Background long-poll of a controller's weight table.

    Parameters
    ----------
    controller_url : str
        ``http(s)://host:port`` of the controller (a trailing ``/`` is ignored).
    table_name : str
        Local weight-table segment to write.
    poll_timeout_s : float
        ``timeout_s`` asked of the controller: how long it may hold a poll.
    timeout_margin_s : float
        Extra time the HTTP request may take beyond ``poll_timeout_s``.
    connect_timeout_s : float
        TCP/TLS connect timeout.
    backoff_initial_s, backoff_max_s : float
        Backoff after the first error, and its cap; doubled per consecutive error,
        with jitter (each wait is uniform in [d/2, d]).
    lock_retry_s : float
        How often a standby worker retries the table's writer lock.
    rng : callable, optional
        Uniform [0, 1) source for the jitter (default ``random.random``).
    fallback_urls : tuple of str
        More controllers, tried in turn after the current one fails to answer (connection
        error, timeout, an HTTP error such as a follower's 503 when it knows no leader):
        several controllers on etcd, any of which redirects to the leader.
    cluster : str, optional
        The proxy's ``proxy.cluster``, sent as ``cluster=``: the controller answers with this
        region's rows only (over the engines they weight or that are flagged), which is all the
        proxy's fleet reads. None: the full table (every proxy sharing the local table gets
        its rows, e.g. proxies of several regions on one host under one ``table_name``).
    leader : EtcdLeader, optional
        Reads the leader's URL from etcd before the first poll and after each failed one.
    failover_backoff_max_s : float
        Cap of the wait while a controller answers without serving a table (default
        :data:`FAILOVER_BACKOFF_MAX_S`).
    stale_table_max_age_s : float, optional
        When this worker takes the writer lock of a table older than this (its writer gone
        long ago: ``proxy.stale_table_max_age_s``), the table's epoch fence is dropped, so the
        controller's first table replaces it whatever its epoch (another deployment's table
        must not fence this one's controller off). None: the fence is kept.

    Attributes
    ----------
    controller_generation : int
        The controller's generation last applied (0 before the first).
    local_generation : int
        Generation of the local table after the last publication.
    updates_total, polls_total : int
    errors_total : dict of str to int
        Failed polls by kind: ``connect``, ``timeout``, ``http``, ``decode``,
        ``table``, ``too_large``, ``fenced``, ``other``.
    active : bool
        This worker holds the writer lock (False: standby or not started).
    last_error : str or None
        The most recent error, cleared by a successful poll.
    """

    def __init__(
        self,
        controller_url: str,
        table_name: str,
        *,
        poll_timeout_s: float = 30.0,
        timeout_margin_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        backoff_initial_s: float = 0.25,
        backoff_max_s: float = 15.0,
        lock_retry_s: float = 5.0,
        rng: Callable[[], float] = random.random,
        fallback_urls: tuple[str, ...] = (),
        cluster: str | None = None,
        leader: EtcdLeader | None = None,
        failover_backoff_max_s: float = FAILOVER_BACKOFF_MAX_S,
        stale_table_max_age_s: float | None = None,
    ) -> None:
        self.urls = [u.rstrip("/") + "/v1/table" for u in (controller_url, *fallback_urls)]
        self.url = self.urls[0]
        self.leader = leader
        self.failover_backoff_max_s = failover_backoff_max_s
        self.stale_table_max_age_s = stale_table_max_age_s
        self._index = 0  # of self.urls: the static URL tried last
        self._ask_leader = leader is not None
        self._alive_seen = False  # a controller answered since the last good poll
        self._failed_url: str | None = None
        self.table_name = table_name
        self.poll_timeout_s = poll_timeout_s
        self.timeout_margin_s = timeout_margin_s
        self.connect_timeout_s = connect_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.lock_retry_s = lock_retry_s
        self.rng = rng
        self.cluster = cluster
        self.controller_generation = 0
        self.local_generation = 0
        #: Controller epoch (``meta["epoch"]``) of the table in force; None: none carried one.
        self.epoch: int | None = None
        #: Tables refused because their epoch is older than :attr:`epoch` (a deposed leader's).
        self.fenced_total = 0
        self.updates_total = 0
        self.polls_total = 0
        self.errors_total: dict[str, int] = {}
        self.active = False
        self.last_error: str | None = None
        self._consecutive_errors = 0
        self._writer: TableWriter | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- one poll ---------------------------------------------------------------------------

    async def poll_once(self) -> bool:
        """One long-poll; return True if a new table was published locally.

        Raises
        ------
        aiohttp.ClientError, asyncio.TimeoutError, PullError, WireError, TableError
            The poll failed; the local table is unchanged.
        """
        assert self._session is not None and self._writer is not None
        self.polls_total += 1
        params = {"after": str(self.controller_generation), "timeout_s": f"{self.poll_timeout_s:g}"}
        if self.epoch is not None:  # a controller of another epoch answers at once
            params["epoch"] = str(self.epoch)
        if self.cluster is not None:  # this region's rows only
            params["cluster"] = self.cluster
        timeout = aiohttp.ClientTimeout(
            total=self.poll_timeout_s + self.timeout_margin_s, connect=self.connect_timeout_s
        )
        try:
            data = await self._fetch(params, timeout)
        except _Redirect as hop:  # a follower names the leader: ask it, and keep asking it
            self._alive_seen = True
            self.url = hop.url
            try:
                data = await self._fetch(params, timeout)
            except _Redirect as again:  # one hop only: the leader itself must answer
                raise PullError("http", f"redirected again, to {again.url}", alive=True) from None
        if data is None:
            return False
        snap = await asyncio.to_thread(decode_snapshot, data)
        epoch = snap.meta.get("epoch") if snap.meta_bytes else None
        epoch = epoch if isinstance(epoch, int) else None
        self._fence(epoch)
        if snap.generation == self.controller_generation and epoch == self.epoch:
            return False
        if snap.generation < self.controller_generation and epoch == self.epoch:
            logger.warning(
                "controller generation went back from %d to %d (controller restarted?)",
                self.controller_generation,
                snap.generation,
            )
        try:
            self.local_generation = await asyncio.to_thread(publish_snapshot, self._writer, snap)
        except TableFencedError as exc:  # the local segment holds a newer epoch already
            self.fenced_total += 1
            raise PullError("fenced", str(exc)) from None
        self.controller_generation = snap.generation
        self.epoch = epoch  # None: back to a single controller without an election
        self.updates_total += 1
        logger.info(
            "weights: controller generation %d published as local generation %d of %r",
            snap.generation,
            self.local_generation,
            self.table_name,
        )
        return True

    async def _fetch(self, params: dict[str, str], timeout: aiohttp.ClientTimeout) -> bytes | None:
        """One GET of :attr:`url`: the snapshot body, or None for 304 (nothing newer).

        Raises :class:`_Redirect` for a follower's redirect (not followed by aiohttp: the
        puller keeps the leader's URL), :class:`PullError` for another status."""
        assert self._session is not None
        headers = {"Accept": MSGPACK_CONTENT_TYPE}
        async with self._session.get(
            self.url, params=params, headers=headers, timeout=timeout, allow_redirects=False
        ) as resp:
            if resp.status == 304:
                return None
            if resp.status in (301, 302, 303, 307, 308):
                raise _Redirect(_leader_table_url(resp.headers, self.url))
            if resp.status != 200:
                alive = resp.status in _ALIVE_STATUSES
                raise PullError("http", f"controller answered HTTP {resp.status}", alive=alive)
            if (resp.content_length or 0) > MAX_SNAPSHOT_BYTES:
                raise PullError("too_large", f"snapshot of {resp.content_length} bytes")
            data = await read_bounded(resp.content, MAX_SNAPSHOT_BYTES)
            if len(data) > MAX_SNAPSHOT_BYTES:
                raise PullError("too_large", f"snapshot over {MAX_SNAPSHOT_BYTES} bytes")
        return data

    def _fence(self, epoch: int | None) -> None:
        """Refuse a table of an older epoch than the one in force (a deposed leader's).

        Counted, logged once (the error text names both epochs) and backed off like an error,
        so a stale controller answering at once cannot spin the poll loop. Tables without an
        epoch (one controller, no HA) always pass."""
        if epoch is None or self.epoch is None or epoch >= self.epoch:
            return
        self.fenced_total += 1  # _record_error logs it once per (epoch, epoch in force)
        raise PullError("fenced", f"table of epoch {epoch} older than {self.epoch}", alive=True)

    # -- the task -----------------------------------------------------------------------------

    def round_size(self) -> int:
        """Controllers one round of immediate retries asks: the URLs, plus etcd's leader."""
        return len(self.urls) + (1 if self.leader is not None else 0)

    def _backoff_s(self) -> float:
        d = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (self._consecutive_errors - 1))
        return d * (0.5 + 0.5 * self.rng())

    def _wait_s(self, kind: str) -> float:
        """The wait before the next poll after an error of ``kind`` (the catch-up bounds)."""
        if kind not in _ROTATE_KINDS:
            return self._backoff_s()
        if self.round_size() > 1 and self._consecutive_errors <= self.round_size():
            return 0.0  # another controller may lead: ask it now
        if self._alive_seen:  # an election is under way: look again soon
            return min(self.failover_backoff_max_s, self._backoff_s())
        return self._backoff_s()

    def _rotate(self) -> None:
        """Ask another controller next: etcd's leader (unless it is the one that failed), else
        the next static URL (also after a leader reached by a redirect failed: the follower
        that sent us there may still name it)."""
        self._failed_url = self.url
        self._ask_leader = self.leader is not None
        self._index = (self._index + 1) % len(self.urls)
        self.url = self.urls[self._index]

    async def _choose_url(self) -> None:
        """Before a poll after an error (or the first): the URL etcd's leader key names."""
        if not self._ask_leader or self.leader is None:
            return
        self._ask_leader = False
        found = await self.leader.lookup()
        if found is None:
            return
        url = found.url + "/v1/table"
        if url != self._failed_url:
            self.url = url

    def _record_error(self, exc: BaseException) -> str:
        if isinstance(exc, PullError):
            kind = exc.kind
        elif isinstance(exc, asyncio.TimeoutError):
            kind = "timeout"
        elif isinstance(exc, aiohttp.ClientError):
            kind = "connect"
        elif isinstance(exc, WireError):
            kind = "decode"
        elif isinstance(exc, TableError):
            kind = "table"
        else:
            kind = "other"
        self.errors_total[kind] = self.errors_total.get(kind, 0) + 1
        self._alive_seen = self._alive_seen or getattr(exc, "alive", False)
        self._consecutive_errors += 1
        text = f"{kind}: {type(exc).__name__}: {exc}"
        if text != self.last_error:
            logger.warning(
                "weights pull from %s failed, keeping the last good table: %s", self.url, text
            )
        self.last_error = text
        if kind in _ROTATE_KINDS:  # try another controller (after the log: it names this one)
            self._rotate()
        return kind

    def _acquire_writer(self) -> bool:
        try:
            self._writer = TableWriter(self.table_name)
        except TableLockedError:
            if self.active or self.last_error != "standby":
                logger.info(
                    "weights: table %r has another writer; this worker stands by", self.table_name
                )
            self.active = False
            self.last_error = "standby"
            return False
        self.active = True
        self.last_error = None
        self.local_generation = self._writer.generation
        self._unfence_stale()
        logger.info("weights: this worker pulls %s into %r", self.url, self.table_name)
        return True

    def _unfence_stale(self) -> None:
        """Drop the epoch fence of a table taken over long after its writer left (its epoch
        may be another deployment's, higher than this one's controller will ever send)."""
        assert self._writer is not None
        if self.stale_table_max_age_s is None or self._writer.epoch is None:
            return
        table = describe(self.table_name)
        if table is not None and table.age_s > self.stale_table_max_age_s:
            logger.warning(
                "weights: table %r is %.0f s old (epoch %d): the controller's first table "
                "replaces it whatever its epoch",
                self.table_name,
                table.age_s,
                self._writer.epoch,
            )
            self._writer.epoch = None

    async def run(self) -> None:
        """Poll forever (cancel to stop); the local table stays for its readers."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1), auto_decompress=True
        )
        try:
            while True:
                if self._writer is None:
                    try:
                        acquired = self._acquire_writer()
                    except (TableError, OSError) as exc:
                        self._record_error(exc)
                        await asyncio.sleep(self._backoff_s())
                        continue
                    if not acquired:
                        await asyncio.sleep(self.lock_retry_s)
                        continue
                try:
                    await self._choose_url()
                    await self.poll_once()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # every failure keeps the last table
                    kind = self._record_error(exc)
                    await asyncio.sleep(self._wait_s(kind))
                else:
                    self._consecutive_errors = 0
                    self._alive_seen = False
                    self._failed_url = None
                    self.last_error = None
        finally:
            await self.close()

    async def close(self) -> None:
        """Release the writer lock and the HTTP session."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None
            self.active = False
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.leader is not None:
            await self.leader.close()


def _leader_table_url(headers: Mapping[str, str], current: str) -> str:
    """The leader's ``/v1/table`` from a follower's redirect: its ``x-fastroute-leader`` header,
    else the ``Location`` (resolved against ``current``) without its query (ours is sent)."""
    leader = headers.get("x-fastroute-leader")
    if leader:
        return leader.rstrip("/") + "/v1/table"
    location = urljoin(current, headers.get("Location", ""))
    if not location.startswith(("http://", "https://")):
        raise PullError("http", f"redirect to {location!r}: not an HTTP URL", alive=True)
    return location.split("?", 1)[0]
