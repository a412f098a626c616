"""A bounded map from stored-response ids to engines, shared by the workers of one host.

The Responses API stores a response on the engine that made it; a follow-up request
naming it (``previous_response_id``) or a ``GET /v1/responses/{id}`` has to reach that
engine. Any worker may serve the follow-up, so the map lives in shared memory.

Layout (little-endian, 8-byte words): a header (magic, capacity, a stamp counter),
then ``capacity`` entries of three words each: the id's 64-bit hash (the caller's,
never 0), the engine's stable 64-bit id and the stamp of the write. The table is
set-associative: an id's hash picks a bucket of :data:`WAYS` entries; a write
overwrites the entry of the same hash, else the bucket's oldest (lowest stamp). So it
never grows, and when full the oldest mapping of the bucket goes first.

Concurrent writers and readers use the atomics of :mod:`fastroute._core`: a writer
clears the entry's hash, stores engine and stamp, then the hash; a reader takes the
engine only if the hash reads the same before and after. Two writers racing for one
bucket may lose one mapping (the follow-up is then routed normally and the engine
answers its own 404): the map is a routing hint, not a store.
"""

from __future__ import annotations

import os
import struct
import tempfile
from typing import Any

from fastroute._core import AtomicBuffer
from fastroute.errors import TableFormatError, TableSizeError, TableValueError
from fastroute.tables.segment import (
    WriterLock,
    close_mapping,
    create_segment,
    map_segment,
    open_existing,
    remove_segment,
    segment_path,
)

__all__ = ["ResponseMap", "WAYS", "DEFAULT_RESPONSE_MAP_CAPACITY", "response_map_name"]

#: Entries per bucket: a lookup reads at most this many entries.
WAYS = 8
#: Entries of a map unless configured (``proxy.response_map_capacity``): 24 bytes each.
DEFAULT_RESPONSE_MAP_CAPACITY = 65536
#: First word of a valid map segment ("FRRESPMP").
RESPONSE_MAP_MAGIC = int.from_bytes(b"FRRESPMP", "little")
_HEADER = struct.Struct("<QQQ")  # magic, capacity, stamp counter
_STAMP_AT = 16
_ENTRY_WORDS = 3
_ENTRY_SIZE = 8 * _ENTRY_WORDS
_MASK64 = (1 << 64) - 1


def response_map_name(stats_name: str) -> str:
    """The segment name of the map that goes with stats block ``stats_name``."""
    return f"{stats_name}.responses"


def _segment_size(capacity: int) -> int:
    return _HEADER.size + capacity * _ENTRY_SIZE


class ResponseMap:
    """A fixed-capacity, shared id-hash → engine-id map (see the module docstring).

    Use :meth:`create` once per host (the supervisor) and :meth:`attach` in each worker;
    :meth:`private` for one process alone (no supervisor).

    Parameters
    ----------
    mm : mmap.mmap
        The mapped segment, header already valid.
    fd : int
        Its file (the pure-Python atomics lock it).
    capacity : int
        Entries, a positive multiple of :data:`WAYS`.
    lock : WriterLock, optional
        Held by the creator of a named segment.
    name : str, optional
        The segment's name (None for a private map).
    """

    def __init__(
        self,
        mm: Any,
        fd: int,
        capacity: int,
        lock: WriterLock | None = None,
        name: str | None = None,
    ) -> None:
        self.name = name
        self.capacity = capacity
        self._buckets = capacity // WAYS
        self._mm = mm
        self._fd = fd
        self._lock = lock
        self._atomic = AtomicBuffer(mm, writable=True, lock_fd=fd)

    # -- life cycle ----------------------------------------------------------------

    @staticmethod
    def _check_capacity(capacity: int) -> None:
        if capacity < WAYS or capacity % WAYS:
            raise TableValueError(
                f"response map capacity must be a positive multiple of {WAYS}, got {capacity}"
            )

    @staticmethod
    def _write_header(mm: Any, capacity: int) -> None:
        _HEADER.pack_into(mm, 0, 0, capacity, 0)
        mm[0:8] = RESPONSE_MAP_MAGIC.to_bytes(8, "little")  # magic last: now valid

    @classmethod
    def create(cls, name: str, capacity: int = DEFAULT_RESPONSE_MAP_CAPACITY) -> ResponseMap:
        """Create an empty named map (replacing an old one of that name).

        Raises
        ------
        fastroute.errors.TableLockedError
            Another live process owns the name.
        fastroute.errors.TableValueError
            ``capacity`` is not a positive multiple of :data:`WAYS`.
        """
        cls._check_capacity(capacity)
        fd, mm, lock = create_segment(
            name, _segment_size(capacity), lambda mm: cls._write_header(mm, capacity)
        )
        return cls(mm, fd, capacity, lock, name)

    @classmethod
    def attach(cls, name: str) -> ResponseMap:
        """Attach to the named map another process created.

        Raises
        ------
        fastroute.errors.TableNotFoundError, TableFormatError, TableSizeError
        """
        fd = open_existing(segment_path(name), writable=True)
        try:
            magic, capacity, _ = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
            if magic != RESPONSE_MAP_MAGIC or capacity < WAYS or capacity % WAYS:
                raise TableFormatError(f"segment {name!r} is not a fastroute response map")
            size = os.fstat(fd).st_size
            if size < _segment_size(capacity):
                raise TableSizeError(f"response map {name!r} is {size} bytes, too short")
            mm = map_segment(fd, _segment_size(capacity), writable=True)
        except BaseException:
            os.close(fd)
            raise
        return cls(mm, fd, capacity, None, name)

    @classmethod
    def private(cls, capacity: int = DEFAULT_RESPONSE_MAP_CAPACITY) -> ResponseMap:
        """A map of this process alone (an unnamed, already unlinked file)."""
        cls._check_capacity(capacity)
        fd, path = tempfile.mkstemp(prefix="fastroute-responses-")
        os.unlink(path)
        os.ftruncate(fd, _segment_size(capacity))
        mm = map_segment(fd, _segment_size(capacity), writable=True)
        cls._write_header(mm, capacity)
        return cls(mm, fd, capacity)

    def close(self) -> None:
        """Detach; the creator also removes the named segment."""
        if self._mm is None:
            return
        self._atomic.release()
        close_mapping(self._mm)
        self._mm = None
        os.close(self._fd)
        if self._lock is not None and self.name is not None:
            remove_segment(self.name, self._lock)
            self._lock = None

    # -- access --------------------------------------------------------------------

    def _bucket_offset(self, key: int) -> int:
        return _HEADER.size + (key % self._buckets) * WAYS * _ENTRY_SIZE

    def put(self, key: int, engine: int) -> None:
        """Map the id hash ``key`` (non-zero) to the engine id ``engine``."""
        if not 0 < key <= _MASK64:
            raise TableValueError(f"response map keys are non-zero 64-bit hashes, got {key}")
        atomic = self._atomic
        stamp = atomic.add_i64(_STAMP_AT, 1) & _MASK64
        base = self._bucket_offset(key)
        victim, oldest = base, _MASK64 + 1
        for way in range(WAYS):
            at = base + way * _ENTRY_SIZE
            if atomic.load_u64(at) == key:
                victim = at
                break
            entry_stamp = atomic.load_u64(at + 16)
            if entry_stamp < oldest:
                victim, oldest = at, entry_stamp
        atomic.store_u64(victim, 0)  # readers skip the entry while it is rewritten
        atomic.store_u64(victim + 8, engine & _MASK64)
        atomic.store_u64(victim + 16, stamp)
        atomic.store_u64(victim, key)

    def get(self, key: int) -> int | None:
        """The engine id mapped to ``key``, or None (never stored, or overwritten)."""
        if key == 0:
            return None
        atomic = self._atomic
        base = self._bucket_offset(key)
        for way in range(WAYS):
            at = base + way * _ENTRY_SIZE
            if atomic.load_u64(at) == key:
                engine = atomic.load_u64(at + 8)
                if atomic.load_u64(at) == key:
                    return engine
        return None

    def __len__(self) -> int:
        """Entries in use (a snapshot)."""
        atomic = self._atomic
        return sum(
            1 for i in range(self.capacity) if atomic.load_u64(_HEADER.size + i * _ENTRY_SIZE) != 0
        )
