"""The host's key log: the pure-Python specification of ``prefix.pyx``'s ``KeyLog``.

Every worker of a proxy keeps its own ``prefix-hrw`` tables (the share table that tells
hot groups, the seen table that prices a cached prefix). Fed only with the requests the
worker itself routed, each of ``W`` workers sees ``1/W`` of the host's traffic: a share
estimate that lags ``W`` times longer, a seen table that misses what the others sent
(``bench/shared_tables.py``: at 4 workers, ``bursts`` lost 4.5 % of goodput and
``prefix-tree`` 3 % at 90 % load, all of it back with one table for the host). The
log carries the keys each worker routes to the others, so every worker's tables count
the host's traffic with the tables' own arithmetic unchanged.

Layout (a buffer of little-endian 8-byte words; a ``/dev/shm`` segment shared by the
workers, :mod:`fastroute.tables.key_log`, or a ``bytearray`` in the simulator):

- header, :data:`HEADER_WORDS` words: magic ``"FRKEYLOG"``, layout version, capacity
  (entries, a power of two), words per entry, ``head`` (entries reserved so far), then
  reserved words;
- ``capacity`` entries of :data:`ENTRY_WORDS` words: ``seq`` (the entry's position + 1
  once published, 0 while it is written), ``meta`` (writer id in bits 0-31, channel in
  32-39, key count in 40-47, count the share table observes in 48-55, bit 56
  :data:`IMPORTED`, bit 57 :data:`WHOLE`: layout version 3), ``engine`` (the id of the
  engine the request was routed to, 0 if not known; layout version 2), then up to
  :data:`~fastroute._core.prefix_py.MAX_DEPTH_KEYS` key hashes.

Publish: ``position = head++`` (atomic); ``seq = 0``; fence; meta and keys;
``seq = position + 1`` (release). Drain, from the reader's next position to ``head``:
when it is more than ``capacity`` behind, it jumps to ``head - capacity`` (the skipped
entries were overwritten: counted ``lost``); an entry whose ``seq`` is not its position + 1
before and after copying it is being written or was overwritten meanwhile, and is
skipped (``lost``: no reader ever waits on a writer, so a writer killed mid-entry stalls
nobody). A valid entry of another writer on the reader's channel is observed: its first
``n_observe`` keys into the share table, all of them into the seen table with its engine
(each key's last placement), one request each, as ``PrefixPicker.on_routed`` does for the
worker's own requests; an entry marked :data:`WHOLE` carries the request's whole prompt key
last, which goes into the whole prompts' share table alone (repeats spread). A new reader
starts ``capacity`` entries back (or at 0): a worker that starts or reloads warms its
tables with the host's recent requests instead of deciding cold.

Channels keep apart the policy instances of one worker that route different traffic
(the proxy's own, and a disaggregated pool's prefill and decode pickers).

Across proxies (``fastroute.policy.key_exchange``): :meth:`KeyLog.export` reads the
host's own entries from a position on, and the proxy polling a peer appends what it
read into its own host's log with :meth:`KeyLog.publish_imported`, which marks them
:data:`IMPORTED`. Imported entries are observed like any other but never exported
again, so with any number of proxies each entry reaches every other host once. An
entry is exported without its whole key: the whole prompts' shares are the host's.
"""

from __future__ import annotations

from typing import Any

from fastroute._core.prefix_py import MAX_DEPTH_KEYS, HotKeys
from fastroute._core.shm_py import AtomicBuffer

__all__ = [
    "ENTRY_WORDS",
    "HEADER_WORDS",
    "IMPORTED",
    "KEY_LOG_MAGIC",
    "KEY_LOG_VERSION",
    "MAX_CHANNEL",
    "WHOLE",
    "KeyLog",
    "init_key_log",
    "key_log_size",
]

#: First word of a valid log ("FRKEYLOG").
KEY_LOG_MAGIC = int.from_bytes(b"FRKEYLOG", "little")
KEY_LOG_VERSION = 3
#: Header words (magic, version, capacity, entry words, head, three reserved).
HEADER_WORDS = 8
#: Words per entry: seq, meta, engine and the keys of one request.
ENTRY_WORDS = 3 + MAX_DEPTH_KEYS
#: Channels are 8 bits of an entry's meta word.
MAX_CHANNEL = 255
#: Meta bit of an entry another proxy's log held first (not exported again).
IMPORTED = 1 << 56
#: Meta bit of an entry whose last key is the request's whole prompt key, observed into
#: the whole prompts' share table only (``PrefixPicker.wholes``).
WHOLE = 1 << 57
_CAPACITY_AT, _ENTRY_WORDS_AT, _HEAD_AT = 16, 24, 32
_MASK32 = 0xFFFFFFFF


def key_log_size(capacity: int) -> int:
    """Bytes of a log of ``capacity`` entries."""
    return 8 * (HEADER_WORDS + capacity * ENTRY_WORDS)


def init_key_log(buffer: Any, capacity: int) -> None:
    """Write an empty log's header into ``buffer`` (zeroed, at least
    :func:`key_log_size` bytes); the magic goes last.

    Raises
    ------
    ValueError
        ``capacity`` is not a power of two >= 16, or the buffer is too short.
    """
    if capacity < 16 or capacity & (capacity - 1):
        raise ValueError(f"key log capacity must be a power of two >= 16, got {capacity}")
    view = memoryview(buffer).cast("B")
    if len(view) < key_log_size(capacity):
        raise ValueError(f"key log of {capacity} entries needs {key_log_size(capacity)} bytes")
    words = view.cast("Q")
    words[1], words[2], words[3], words[4] = KEY_LOG_VERSION, capacity, ENTRY_WORDS, 0
    words[0] = KEY_LOG_MAGIC


class KeyLog:
    """One reader and writer of a key log (see the module docstring).

    Parameters
    ----------
    buffer : writable buffer
        A log :func:`init_key_log` wrote.
    writer_id : int
        This reader's id, 32 bits: its own entries are not observed again. Unique among
        the log's live users.
    channel : int
        0-255: only entries of this channel are observed.
    lock_fd : int, optional
        The segment's file: the pure-Python twin locks it around ``head++`` (the
        compiled core uses CPU atomics). Without it the buffer must belong to one process.

    Raises
    ------
    ValueError
        The buffer does not hold a log of this layout, or an id is out of range.
    """

    def __init__(self, buffer: Any, writer_id: int, channel: int, lock_fd: int | None = None):
        if not 0 <= writer_id <= _MASK32 or not 0 <= channel <= MAX_CHANNEL:
            raise ValueError(
                f"writer_id must fit 32 bits and channel 0-{MAX_CHANNEL}, "
                f"got {writer_id}, {channel}"
            )
        self._atomic = AtomicBuffer(buffer, writable=True, lock_fd=lock_fd)
        self._locked = lock_fd is not None
        atomic = self._atomic
        capacity = atomic.load_u64(_CAPACITY_AT) if atomic.size >= 8 * HEADER_WORDS else 0
        if (
            atomic.size < 8 * HEADER_WORDS
            or atomic.load_u64(0) != KEY_LOG_MAGIC
            or atomic.load_u64(8) != KEY_LOG_VERSION
            or atomic.load_u64(_ENTRY_WORDS_AT) != ENTRY_WORDS
            or capacity < 16
            or capacity & (capacity - 1)
            or atomic.size < key_log_size(capacity)
        ):
            raise ValueError("the buffer does not hold a fastroute key log of this version")
        self.capacity = capacity
        self.writer_id = writer_id
        self.channel = channel
        #: Entries skipped: overwritten before this reader came, or torn by a writer.
        self.lost = 0
        #: Entries of the other writers of this channel observed.
        self.observed = 0
        self._next = max(0, atomic.load_i64(_HEAD_AT) - capacity)

    @property
    def position(self) -> int:
        """The next entry this reader reads."""
        return self._next

    def _entry_at(self, position: int) -> int:
        return 8 * (HEADER_WORDS + (position & (self.capacity - 1)) * ENTRY_WORDS)

    def publish(
        self, keys: list[int], n_observe: int, engine_id: int = 0, whole: int | None = None
    ) -> None:
        """Append one routed request's ``keys`` (at most ``MAX_DEPTH_KEYS``), of which the
        first ``n_observe`` count in the share table, the engine it was routed to (0: not
        known) and its whole prompt key (None: none; dropped when ``keys`` fill the
        entry)."""
        if whole is None or len(keys) >= MAX_DEPTH_KEYS:
            self._append(keys, n_observe, self.channel, 0, engine_id)
        else:
            self._append([*keys, whole], min(n_observe, len(keys)), self.channel, WHOLE, engine_id)

    def publish_imported(
        self, keys: list[int], n_observe: int, channel: int, engine_id: int = 0
    ) -> None:
        """Append an entry another proxy's log exported (:meth:`export`), on ``channel``
        (0-255) and marked :data:`IMPORTED`."""
        if not 0 <= channel <= MAX_CHANNEL:
            raise ValueError(f"channel must be 0-{MAX_CHANNEL}, got {channel}")
        self._append(keys, n_observe, channel, IMPORTED, engine_id)

    def _append(
        self, keys: list[int], n_observe: int, channel: int, flags: int, engine_id: int
    ) -> None:
        atomic = self._atomic
        n_keys = min(len(keys), MAX_DEPTH_KEYS)
        n_observe = max(0, min(n_observe, n_keys))
        if self._locked:
            position = atomic.add_i64(_HEAD_AT, 1) - 1
        else:
            position = atomic.load_i64(_HEAD_AT)
            atomic.store_u64(_HEAD_AT, position + 1)
        at = self._entry_at(position)
        atomic.store_u64(at, 0)
        atomic.fence()
        meta = self.writer_id | channel << 32 | n_keys << 40 | n_observe << 48 | flags
        atomic.store_u64(at + 8, meta)
        atomic.store_u64(at + 16, engine_id)
        for j in range(n_keys):
            atomic.store_u64(at + 24 + 8 * j, keys[j])
        atomic.store_u64(at, position + 1)

    def _read(self, position: int) -> tuple[int, int, list[int]] | None:
        """The entry at ``position`` as (meta, engine id, keys); None if it is being
        written or was overwritten (counted ``lost``)."""
        atomic = self._atomic
        at = self._entry_at(position)
        seq = atomic.load_u64(at)
        meta = atomic.load_u64(at + 8)
        engine_id = atomic.load_u64(at + 16)
        n_keys = (meta >> 40) & 0xFF
        keys = [atomic.load_u64(at + 24 + 8 * j) for j in range(min(n_keys, MAX_DEPTH_KEYS))]
        atomic.fence()
        if seq != position + 1 or atomic.load_u64(at) != seq:
            self.lost += 1
            return None
        return meta, engine_id, keys

    def drain(self, hot: HotKeys, seen: HotKeys, wholes: HotKeys | None = None) -> int:
        """Observe the other writers' entries of this channel published since the last
        drain into ``hot`` and ``seen``, and their whole prompt keys into ``wholes`` (None:
        not counted); return how many were observed."""
        head = self._atomic.load_i64(_HEAD_AT)
        position, observed = self._next, 0
        if head - position > self.capacity:
            self.lost += head - self.capacity - position
            position = head - self.capacity
        while position < head:
            entry = self._read(position)
            if entry is not None:
                meta, engine_id, keys = entry
                if meta & _MASK32 != self.writer_id and (meta >> 32) & 0xFF == self.channel:
                    if wholes is not None:  # every request counts, with its whole key if any
                        wholes.observe(keys[-1:] if meta & WHOLE else (), 1.0)
                    if meta & WHOLE:
                        keys = keys[:-1]
                    hot.observe(keys[: (meta >> 48) & 0xFF], 1.0)
                    seen.observe(keys, 1.0, engine_id)
                    observed += 1
            position += 1
        self._next = position
        self.observed += observed
        return observed

    def export(
        self, since: int, max_entries: int
    ) -> tuple[int, list[tuple[int, int, list[int], int]]]:
        """The host's own entries (every channel, not :data:`IMPORTED`) at positions from
        ``since``, at most ``max_entries`` positions read.

        A ``since`` outside the entries the log holds (-1 on a first call; a log
        recreated since; more than ``capacity`` behind) starts at the oldest one held.
        Returns the position to read from next and the entries as ``(channel,
        n_observe, keys, engine_id)``; this reader's own position and counts other than ``lost``
        do not change.
        """
        head = self._atomic.load_i64(_HEAD_AT)
        oldest = max(0, head - self.capacity)
        position = since if oldest <= since <= head else oldest
        stop = min(head, position + max(0, max_entries))
        entries = []
        while position < stop:
            entry = self._read(position)
            if entry is not None and not entry[0] & IMPORTED:
                meta, engine_id, keys = entry
                if meta & WHOLE:
                    keys = keys[:-1]
                entries.append(((meta >> 32) & 0xFF, (meta >> 48) & 0xFF, keys, engine_id))
            position += 1
        return stop, entries

    def release(self) -> None:
        """Release the buffer (so that its mmap can be closed)."""
        self._atomic.release()
