"""Poll the deployment's other proxies for the prefill they have queued on each engine.

A proxy counts the prompt tokens its own host's attempts have queued on each engine (the
shared stats block: every worker's), not the other proxies'. With ``p`` proxies splitting
the traffic each sees about ``1/p`` of every queue, and ``prefix-hrw``'s load bound and cost
spill decide on that fraction. In the simulator (4 workers × 2 proxies) that cost 6–14 % of
goodput in the long-prompt families against 1 × 1; sharing the proxies' counts every 0.05 s
recovers nearly all of it (docs/fleet-benchmark.md "Several proxies"). Engine scrapes cannot
stand in: an engine reports how many requests wait, not how many tokens, and with
heavy-tailed prompts the count says little about the prefill queued (correlation 0.2–0.4
with the true other proxies' tokens in the same runs).

One worker per host polls: every worker runs a :class:`PeerQueues`, and the one holding the
host's lock (an ``flock`` on ``<stats block>.peers.lock``, removed with the block; the kernel
drops the lock when its holder dies, the others try again every period and one takes over)
sends ``GET /admin/queue`` (:func:`fastroute.proxy.routes.queued_by_engine`) to each
``proxy.peers`` URL every ``proxy.peer_poll_interval_s``, each peer on its own cadence over
one keep-alive connection (the proxy's lean HTTP/1.1 client), with ``proxy.admin_token`` as
a bearer token when set. After every answer it writes the sum of the peers' latest answers
(engine names the fleet does not have are ignored) into the stats block
(:meth:`~fastroute.proxy.path.engine_stats.EngineStats.set_peer_queued`: added to each
engine's ``QUEUED_TOKENS``, which every worker's request path reads, and kept apart in
``PEER_QUEUED_TOKENS``, which ``GET /admin/queue`` takes out again so that no proxy hears its
own queue back). Without a stats block (a lone unsupervised worker) it polls for itself. A peer
that fails or does not answer within :func:`poll_timeout_s` (0.8 of the period, at least
:data:`MIN_POLL_TIMEOUT_S`) counts 0 until its next answer (a dead proxy queues nothing;
its last numbers would only grow stale), and is logged once per distinct error. Each peer
has its own cadence so that a slow or distant one (a peer in another region: a round trip
of up to a few hundred milliseconds) delays only its own figures, not the others'.

The same poll carries the peers' prefix keys (``proxy.peer_key_exchange``, on by default;
:mod:`fastroute.policy.key_exchange`): the request names, per peer, the position read so
far in the peer's key log, the answer adds the peer's own entries from there, and the
poller appends them into its host's log, where every worker's ``prefix-hrw`` tables
observe them. A failed poll keeps the position, so the next one resumes there.

Cost: ``peers / interval`` small GETs per host and as many answered (1 peer at the default
0.05 s: 20 each way per second), each answer listing only the engines with a queue and the
peer's key-log entries since the last poll, about 0.5 ms of CPU per poll on each side (two
idle single-worker proxies: 19 ms of CPU per second per host at 0.05 s, 4 at 0.25 s,
``bench/bench_peer_poll_cost.py``); nothing on the request path (the queued-token counter
it reads already holds the sum).

Exported on ``/metrics``:

=================================================  =======  ==============================
``fastroute_proxy_peer_polls_total``               counter  peer, outcome (ok, failed)
``fastroute_proxy_peer_queued_tokens``             gauge    prompt tokens the peers queued,
                                                            all engines, last round
``fastroute_proxy_peer_poller_active``             gauge    1: this worker polls for the host
``fastroute_proxy_peer_key_entries_total``         counter  peer, outcome: ``imported``
                                                            into the host's key log,
                                                            ``dropped`` (a channel label
                                                            this host lacks, a key past
                                                            64 bits)
=================================================  =======  ==============================
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fastroute.errors import TableLockedError
from fastroute.policy.key_exchange import SINCE_HEADER, KeyExchange, KeyLogExport
from fastroute.proxy.http import http1
from fastroute.proxy.path.fleet import Fleet
from fastroute.proxy.routes import QUEUE_PATH
from fastroute.tables.segment import WriterLock

__all__ = [
    "MAX_ANSWER_BYTES",
    "MIN_POLL_TIMEOUT_S",
    "POLL_TIMEOUT_FRACTION",
    "PeerQueues",
    "PeerQueuesCollector",
    "poll_timeout_s",
]

logger = logging.getLogger(__name__)

#: A poll must answer within this fraction of the period (one peer's polls never overlap)...
POLL_TIMEOUT_FRACTION = 0.8
#: ...or within this many seconds if longer: a peer in another region answers in a round
#: trip of up to a few hundred milliseconds, which a short period must not count as down.
MIN_POLL_TIMEOUT_S = 1.0
#: Largest answer read from a peer, bytes: 1 MB of queues (about 20,000 engines with one)
#: and a full key-log share with 64 keys an entry (about 1.4 MB; 0.1-0.3 MB for real prompts).
MAX_ANSWER_BYTES = 3 << 20


class _Answer(msgspec.Struct):
    engines: dict[str, int]
    key_log: KeyLogExport | None = None


_decode = msgspec.json.Decoder(_Answer).decode


def poll_timeout_s(interval_s: float) -> float:
    """How long a poll of one peer may take, seconds, at period ``interval_s``."""
    return max(POLL_TIMEOUT_FRACTION * interval_s, MIN_POLL_TIMEOUT_S)


class _Peer:
    """One peer: its URL, pool and counters."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.pool: http1.HostPool | None  # None once closed (a new one on the next poll)
        self.pool, _ = http1.pool_for_url(self.url)  # a bad URL fails here, at start
        self.ok_total = 0
        self.failed_total = 0
        self.last_error: str | None = None
        #: Position read so far in the peer's key log (-1: its last ``capacity`` entries).
        self.key_cursor = -1
        self.keys_imported_total = 0
        self.keys_dropped_total = 0
        #: Its latest answer's queued tokens per engine name (empty after a failure).
        self.engines: dict[str, int] = {}

    def connection_pool(self) -> http1.HostPool:
        if self.pool is None:
            self.pool, _ = http1.pool_for_url(self.url)
        return self.pool


class PeerQueues:
    """Sum the other proxies' queued prompt tokens per engine into the host's stats.

    Parameters
    ----------
    peers : sequence of str
        ``http(s)://host:port`` of the other proxies.
    fleet : callable
        Returns the fleet in force (a reload replaces it); each round writes there.
    interval_s : float
        Poll period, seconds.
    admin_token : str, optional
        Sent as ``Authorization: Bearer`` (the peers' admin rule).
    key_exchange : callable, optional
        Returns the worker's :class:`~fastroute.policy.key_exchange.KeyExchange` in force,
        or None (no key log): the peers' key-log entries are then not asked for. Omitted:
        queues only.

    Attributes
    ----------
    rounds_total : int
        Times this worker wrote the peers' sum into its host's stats (after every answer
        of :meth:`run`, once per :meth:`poll_once`).
    active : bool
        This worker polls for its host (holds the lock, or has no stats block).
    """

    def __init__(
        self,
        peers: tuple[str, ...] | list[str],
        fleet: Callable[[], Fleet],
        *,
        interval_s: float = 0.05,
        admin_token: str | None = None,
        key_exchange: Callable[[], KeyExchange | None] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.peers = [_Peer(url) for url in peers]
        self.fleet = fleet
        self.interval_s = interval_s
        self.timeout_s = poll_timeout_s(interval_s)
        self._headers = [("Authorization", f"Bearer {admin_token}")] if admin_token else []
        self.key_exchange = key_exchange or (lambda: None)
        self.rounds_total = 0
        self.active = False
        self._lock: WriterLock | None = None
        self._indexed: Fleet | None = None
        self._index: dict[str, int] = {}

    def _take_turn(self) -> bool:
        """Whether this worker polls for its host now: it holds the host's lock (taking
        it if free), or the fleet has no shared stats block."""
        if self._lock is not None:
            return True
        block = self.fleet().stats.block
        if block is None:
            self.active = True
            return True
        try:
            self._lock = WriterLock(block.peer_poller_path)
        except (TableLockedError, OSError):
            self.active = False
            return False
        self.active = True
        return True

    def release(self) -> None:
        """Stop polling for the host and close connections; the host's peer figures go
        to 0 until another worker takes over."""
        if self.active:
            fleet = self.fleet()
            with contextlib.suppress(ValueError, OSError):  # the block closed first (exit)
                fleet.stats.set_peer_queued(np.zeros(fleet.n_engines, dtype=np.int64))
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self.active = False
        for peer in self.peers:
            if peer.pool is not None:
                peer.pool.close()
                peer.pool = None

    def queued_tokens_total(self) -> int:
        """Prompt tokens the peers had queued at the host's last round, all engines."""
        return int(self.fleet().stats.peer_queued().sum())

    async def poll_once(self) -> None:
        """If this worker polls for its host: poll every peer once, at once, and write the
        sum into the host's stats."""
        if not self._take_turn():
            return
        await asyncio.gather(*(self._poll(p) for p in self.peers))
        self._publish()

    def _publish(self) -> None:
        """Write the sum of the peers' latest answers into the host's stats."""
        fleet = self.fleet()
        if fleet is not self._indexed:  # a fleet's engines are fixed; a reload makes a new one
            self._index = {name: i for i, name in enumerate(fleet.names)}
            self._indexed = fleet
        index = self._index
        total = np.zeros(len(fleet.names), dtype=np.int64)
        for peer in self.peers:
            for name, tokens in peer.engines.items():
                i = index.get(name)
                if i is not None and tokens > 0:
                    total[i] += tokens
        fleet.stats.set_peer_queued(total)
        self.rounds_total += 1

    async def _poll(self, peer: _Peer) -> None:
        """Poll one peer: its queues into ``peer.engines`` (empty, and counted as failed,
        on any error), its key-log entries into the host's log."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        exchange = self.key_exchange()
        headers = self._headers
        if exchange is not None:
            headers = [*headers, (SINCE_HEADER, str(peer.key_cursor))]
        try:
            resp = await peer.connection_pool().request(
                QUEUE_PATH,
                b"",
                headers,
                deadline=deadline,
                connect_timeout_s=self.timeout_s,
                method="GET",
            )
            try:
                body = bytearray()
                while chunk := await resp.read(self.timeout_s, deadline):
                    body += chunk
                    if len(body) > MAX_ANSWER_BYTES:
                        raise ValueError(f"answer larger than {MAX_ANSWER_BYTES} bytes")
            finally:
                resp.close()
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            answer = _decode(bytes(body))
        except (http1.HTTP1Error, OSError, ValueError, msgspec.DecodeError) as exc:
            peer.failed_total += 1
            text = f"{type(exc).__name__}: {exc}"
            if text != peer.last_error:
                logger.warning("queue poll of peer %s failed: %s", peer.url, text)
            peer.last_error = text
            peer.engines = {}
            return
        peer.ok_total += 1
        peer.last_error = None
        if exchange is not None and answer.key_log is not None:
            imported = exchange.absorb(answer.key_log)
            peer.keys_imported_total += imported
            peer.keys_dropped_total += len(answer.key_log.entries) - imported
            peer.key_cursor = answer.key_log.next
        peer.engines = answer.engines

    async def run(self) -> None:
        """Once this worker polls for its host (until then, try every ``interval_s``),
        poll each peer every ``interval_s`` on its own cadence, writing the sum after
        every answer, until cancelled."""
        try:
            while not self._take_turn():
                await asyncio.sleep(self.interval_s)
            await asyncio.gather(*(self._follow(p) for p in self.peers))
        finally:
            self.release()

    async def _follow(self, peer: _Peer) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self._poll(peer)
            self._publish()
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))


class PeerQueuesCollector(Collector):
    """The poller's counters on ``/metrics`` (read at scrape time)."""

    def __init__(self, poller: PeerQueues) -> None:
        self.poller = poller

    def collect(self) -> Iterator[Metric]:
        peers = self.poller.peers
        yield _per_peer(
            "fastroute_proxy_peer_polls",
            "Polls of the other proxies' queued prompt tokens (proxy.peers).",
            {"ok": [p.ok_total for p in peers], "failed": [p.failed_total for p in peers]},
            peers,
        )
        yield GaugeMetricFamily(
            "fastroute_proxy_peer_queued_tokens",
            "Prompt tokens the other proxies had queued on this fleet's engines, last round.",
            value=self.poller.queued_tokens_total(),
        )
        yield _per_peer(
            "fastroute_proxy_peer_key_entries",
            "Key-log entries of the other proxies this host's poller received.",
            {
                "imported": [p.keys_imported_total for p in peers],
                "dropped": [p.keys_dropped_total for p in peers],
            },
            peers,
        )
        yield GaugeMetricFamily(
            "fastroute_proxy_peer_poller_active",
            "1 if this worker polls the other proxies for its host (holds the host's lock).",
            value=1.0 if self.poller.active else 0.0,
        )


def _per_peer(
    name: str, documentation: str, by_outcome: dict[str, list[int]], peers: list[_Peer]
) -> CounterMetricFamily:
    """A counter labelled by peer and outcome: ``by_outcome[outcome][i]`` is peer i's."""
    family = CounterMetricFamily(name, documentation, labels=["peer", "outcome"])
    for i, peer in enumerate(peers):
        for outcome, values in by_outcome.items():
            family.add_metric([peer.url, outcome], values[i])
    return family
