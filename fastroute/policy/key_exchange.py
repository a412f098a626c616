"""Prefix keys passed between proxies on the peer poll.

A host's key log (:mod:`fastroute.tables.key_log`) carries the keys its own workers route,
so every worker's ``prefix-hrw`` tables count the host's traffic. With several proxies in
front of one fleet each host still sees only its share: when the turns of one session
alternate between proxies, the proxy routing turn n may never have seen turn n-1, its seen
table prices the session's cached prefix too low and the cost spill moves the turn off the
engine that holds it. In the simulator that cost ``agentic`` 1.3 / 0.9 points of prefix
hits at 4 workers × 2 proxies (70 / 90 % load, 24 seeds), all of it back with one log for
both proxies and with this exchange (docs/fleet-benchmark.md, "Several workers", "The key
exchange": goodput -0.4 to +1.2 % against no exchange in every family and load).

Mechanism. The worker that polls the peers' queues for its host
(:mod:`fastroute.proxy.background.peer_queues`) sends, per peer, the position it has read
that peer's log to (:data:`SINCE_HEADER`; -1 at first). The peer answers, beside its
queue, a :class:`KeyLogExport`: its host's *own* entries (keys and the engine each
request went to) from there on (not those it
imported itself, so with any number of proxies each entry reaches every other host once),
at most :data:`MAX_EXPORT_ENTRIES` positions per answer, and the label of each channel.
The poller appends them into its own host's log marked imported
(``KeyLog.publish_imported``) on the channel whose label matches (the policy instance
that routes the same traffic; an entry of a label this host lacks, or with a key or an
engine id past 64 bits, is dropped and counted), and every
worker's next drain observes them as it observes its neighbours' entries. Keys are
unseeded hashes of prompt bytes, so equal prompts give equal keys on every host.

Delay: one poll period (0.05 s by default) plus the answer; a follow-up turn arrives after
its previous turn's response, seconds later in chat and agent loops, so the entry is
there when it counts. A first poll (and a worker that takes the poll over from a dead
one) reads the peer's last ``capacity`` entries: a new proxy starts warm, and a takeover
counts those entries a second time once (weighted out by the share table's half-life).

Bounds: :data:`MAX_EXPORT_ENTRIES` positions per answer (20,480 requests per second per
peer at the default 0.05 s period, 4096 at 0.25 s; a peer routing more falls behind, then
skips what its log overwrote); an entry holds at most 64 keys, about 1.4 MB of JSON for a
full answer in the worst case (doubling depths from 512 bytes give 6 keys for a 16 kB prompt
and 12 for 1 MB: 0.1-0.3 kB an entry).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from fastroute._core import KeyLog
from fastroute._core.keylog_py import MAX_CHANNEL
from fastroute._core.prefix_py import MAX_DEPTH_KEYS

__all__ = ["MAX_EXPORT_ENTRIES", "SINCE_HEADER", "KeyExchange", "KeyLogExport"]

#: Request header of the queue poll: the position the poller has read the peer's log to.
SINCE_HEADER = "X-Fastroute-Key-Log-Since"
#: Log positions one answer reads at most.
MAX_EXPORT_ENTRIES = 1024

_Key = Annotated[int, msgspec.Meta(ge=0)]  # < 2**64 is checked on import (msgspec: int64)
_Byte = Annotated[int, msgspec.Meta(ge=0, le=MAX_CHANNEL)]
_Entry = tuple[_Byte, _Byte, Annotated[list[_Key], msgspec.Meta(max_length=MAX_DEPTH_KEYS)]]


class KeyLogExport(msgspec.Struct, array_like=True):
    """One answer's share of a host's key log.

    Attributes
    ----------
    next : int
        The position to ask from next time.
    channels : list of str
        The label of each channel of the exporting host (index = channel).
    entries : list of (int, int, list of int)
        ``(channel, n_observe, keys)`` of each of its own entries, oldest first.
    engines : list of int
        The engine each entry's request was routed to (0: not known), one per entry; a
        trailing field, so that proxies of the version before it (which send none and
        ignore it) still exchange keys: with any other length every entry's is 0. The
        id of an engine is the same on every proxy (``fastroute.hashing.engine_id`` of its
        configured name).
    """

    next: Annotated[int, msgspec.Meta(ge=0)]
    channels: Annotated[list[str], msgspec.Meta(max_length=MAX_CHANNEL + 1)]
    entries: Annotated[list[_Entry], msgspec.Meta(max_length=MAX_EXPORT_ENTRIES)]
    engines: Annotated[list[_Key], msgspec.Meta(max_length=MAX_EXPORT_ENTRIES)] = []


class KeyExchange:
    """A worker's end of the exchange: exports its host's log, imports a peer's.

    Parameters
    ----------
    buffer : writable buffer
        The host's key log.
    labels : sequence of str
        The label of each channel, in channel order (the same policy instance must have
        the same label on every proxy).
    lock_fd : int, optional
        The segment's file (the pure-Python ``KeyLog`` locks it).
    """

    def __init__(self, buffer: Any, labels: Sequence[str], lock_fd: int | None = None) -> None:
        self.log = KeyLog(buffer, secrets.randbits(32), 0, lock_fd)
        self.labels = list(labels)
        self._channel_of = {label: channel for channel, label in enumerate(self.labels)}

    def export(self, since: int) -> KeyLogExport:
        """The host's own entries from position ``since`` (see ``KeyLog.export``)."""
        next_position, entries = self.log.export(since, MAX_EXPORT_ENTRIES)
        return KeyLogExport(
            next_position,
            self.labels,
            [(channel, n_observe, keys) for channel, n_observe, keys, _ in entries],
            [engine for *_, engine in entries],
        )

    def absorb(self, export: KeyLogExport) -> int:
        """Append a peer's entries into the host's log on the channels whose labels
        match; return how many were appended. The others are dropped: their channel's
        label is not one of this host's, or a key does not fit 64 bits (the poller counts
        both per peer)."""
        ours = [self._channel_of.get(label) for label in export.channels]
        imported = 0
        publish = self.log.publish_imported
        engines = export.engines
        if len(engines) != len(export.entries):
            engines = [0] * len(export.entries)
        for (channel, n_observe, keys), engine in zip(export.entries, engines, strict=True):
            mine = ours[channel] if channel < len(ours) else None
            if mine is not None and not engine >> 64 and not any(key >> 64 for key in keys):
                publish(keys, n_observe, mine, engine)
                imported += 1
        return imported
