"""Per-engine live statistics shared by every worker process of one host.

In-flight counts (for least-request and the bounded-load guard), totals and EWMAs
of in-band latencies, one 64-byte slot per engine, updated with atomic operations
from the compiled core (``fastroute._core.AtomicBuffer``) so that concurrent
workers never lose an update.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from fastroute._core import AtomicBuffer
from fastroute.errors import (
    TableDimensionError,
    TableFormatError,
    TableNotFoundError,
    TableSizeError,
    TableValueError,
    TableVersionError,
)
from fastroute.tables.layout import (
    HEADER_SIZE,
    STATS_HEADER,
    STATS_LAYOUT_VERSION,
    STATS_MAGIC,
    STATS_SLOT_SIZE,
    Counter,
    Ewma,
    StatsLayout,
)
from fastroute.tables.segment import (
    WriterLock,
    close_mapping,
    lock_path,
    map_segment,
    open_existing,
    segment_path,
)

__all__ = ["StatsBlock", "Counter", "Ewma", "DEFAULT_EWMA_ALPHA"]

#: The header's engine count (``n_engines``, uint32 after magic, version, header size and
#: ``max_engines``): the one field that changes after creation (:meth:`StatsBlock.add_engines`).
STATS_COUNT = struct.Struct("<I")
STATS_COUNT_OFFSET = struct.calcsize("<QIII")
assert STATS_HEADER.format[:5] + "I" == "<QIIII"  # the count follows those four fields

#: Weight of a new sample in the in-band latency EWMAs.
DEFAULT_EWMA_ALPHA = 0.2


class StatsBlock:
    """A shared-memory block of per-engine counters and EWMAs.

    Use :meth:`create` once per host (the process that starts the workers; it owns
    the name until it closes) and :meth:`attach` in every worker.
    """

    def __init__(
        self,
        name: str,
        path: Path,
        fd: int,
        mm: Any,
        layout: StatsLayout,
        n_engines: int,
        lock: WriterLock | None,
    ) -> None:
        self.name = name
        self.path = path
        self.layout = layout
        self.n_engines = n_engines
        self._slots_offset = layout.slots_offset
        self._fd = fd
        self._mm = mm
        self._lock = lock
        self._atomic = AtomicBuffer(mm, writable=True, lock_fd=fd)
        ids = np.frombuffer(mm, dtype="<u8", count=n_engines, offset=layout.engine_ids_offset)
        self.engine_ids: np.ndarray = ids.copy()
        self.engine_ids.flags.writeable = False
        self._slot_of = {int(e): i for i, e in enumerate(self.engine_ids)}

    # -- life cycle ----------------------------------------------------------------

    @classmethod
    def create(
        cls, name: str, engine_ids: Any, *, max_engines: int | None = None, mode: int = 0o600
    ) -> StatsBlock:
        """Create a fresh, zeroed block for ``engine_ids`` (replacing any old one).

        Raises
        ------
        fastroute.errors.TableLockedError
            Another live process owns the name.
        fastroute.errors.TableValueError, TableDimensionError
            Ids are not unique, or more than ``max_engines``.
        """
        ids = np.ascontiguousarray(engine_ids, dtype="<u8")
        if ids.ndim != 1 or len(np.unique(ids)) != ids.shape[0]:
            raise TableValueError("engine_ids must be a 1-D sequence of unique ids")
        layout = StatsLayout(max_engines if max_engines is not None else max(1, ids.shape[0]))
        if ids.shape[0] > layout.max_engines:
            raise TableDimensionError(
                f"{ids.shape[0]} engines do not fit a stats block of {layout.max_engines}"
            )
        path = segment_path(name)
        lock = WriterLock(path)
        try:
            tmp = path.with_name(path.name + ".tmp")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
            os.ftruncate(fd, layout.segment_size)
            mm = map_segment(fd, layout.segment_size, writable=True)
            STATS_HEADER.pack_into(
                mm,
                0,
                0,
                STATS_LAYOUT_VERSION,
                HEADER_SIZE,
                layout.max_engines,
                ids.shape[0],
                layout.slots_offset,
            )
            start = layout.engine_ids_offset
            mm[start : start + 8 * ids.shape[0]] = ids.tobytes()
            nan = np.full(len(Ewma), np.nan, dtype="<f8").tobytes()
            for slot in range(ids.shape[0]):
                ewma_at = layout.slot_offset(slot) + min(Ewma)
                mm[ewma_at : ewma_at + len(nan)] = nan
            mm[0:8] = STATS_MAGIC.to_bytes(8, "little")  # magic last: now valid
            os.rename(tmp, path)
        except BaseException:
            lock.release()
            raise
        return cls(name, path, fd, mm, layout, int(ids.shape[0]), lock)

    @classmethod
    def attach(cls, name: str) -> StatsBlock:
        """Attach to an existing block (any number of processes)."""
        path = segment_path(name)
        fd = open_existing(path, writable=True)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise TableSizeError(
                    f"stats block {name!r} is {size} bytes, shorter than its header"
                )
            magic, version, header_size, max_e, n_e, slots_offset = STATS_HEADER.unpack(
                os.pread(fd, STATS_HEADER.size, 0)
            )
            if magic == 0:
                raise TableNotFoundError(f"stats block {name!r} is not initialised yet")
            if magic != STATS_MAGIC:
                raise TableFormatError(
                    f"segment {name!r} has magic {magic:#018x}, expected {STATS_MAGIC:#018x}: "
                    "it is not a fastroute stats block"
                )
            if version != STATS_LAYOUT_VERSION:
                raise TableVersionError(
                    f"stats block {name!r} has layout version {version}; this fastroute "
                    f"reads version {STATS_LAYOUT_VERSION}"
                )
            layout = StatsLayout(max_e)
            if header_size != HEADER_SIZE or slots_offset != layout.slots_offset or n_e > max_e:
                raise TableFormatError(f"stats block {name!r} has an inconsistent header")
            if size < layout.segment_size:
                raise TableSizeError(
                    f"stats block {name!r} is {size} bytes; its header requires "
                    f"{layout.segment_size}"
                )
            mm = map_segment(fd, layout.segment_size, writable=True)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, path, fd, mm, layout, n_e, None)

    def close(self) -> None:
        """Detach; the creator also gives up the name (the file stays)."""
        if self._mm is None:
            return
        self._atomic.release()
        close_mapping(self._mm)
        self._mm = None
        os.close(self._fd)
        if self._lock is not None:
            self._lock.release()

    @property
    def peer_poller_path(self) -> Path:
        """What the host's peer poller locks (a :class:`WriterLock` on it: one worker per
        host polls ``proxy.peers``); :meth:`unlink` removes its lock file too."""
        return self.path.with_name(self.path.name + ".peers")

    def unlink(self) -> None:
        """Remove the block's files and close (creator only)."""
        if self._lock is None:
            raise TableValueError(f"only the creator of stats block {self.name!r} may unlink it")
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        lock_path(self.peer_poller_path).unlink(missing_ok=True)
        lock, self._lock = self._lock, None
        self.close()
        lock.release(unlink=True)

    def add_engines(self, engine_ids: Any) -> list[int]:
        """Give slots to engines that have none, while the block has room (creator only).

        Slots are never reused: an engine keeps its slot for the block's life, so a
        reload that removes and re-adds it finds its counters again. The ids are
        written before the engine count, so a reader that sees the new count sees them.

        Parameters
        ----------
        engine_ids : sequence of int
            Engine ids; those already in the block are skipped.

        Returns
        -------
        list of int
            The ids that did not fit (the block is full): they have no slot.
        """
        if self._lock is None or self._mm is None:
            raise TableValueError(f"only the creator of stats block {self.name!r} may add engines")
        new = [int(e) for e in dict.fromkeys(int(e) for e in engine_ids) if e not in self._slot_of]
        room = self.layout.max_engines - self.n_engines
        fits, rest = new[:room], new[room:]
        nan = np.full(len(Ewma), np.nan, dtype="<f8").tobytes()
        for slot, eid in enumerate(fits, start=self.n_engines):
            at = self.layout.engine_ids_offset + 8 * slot
            self._mm[at : at + 8] = eid.to_bytes(8, "little")
            ewma_at = self.layout.slot_offset(slot) + min(Ewma)
            self._mm[ewma_at : ewma_at + len(nan)] = nan
        if fits:
            STATS_COUNT.pack_into(self._mm, STATS_COUNT_OFFSET, self.n_engines + len(fits))
            self._adopt(self.n_engines + len(fits))
        return rest

    def refresh(self) -> None:
        """Adopt the engines the creator added since this process attached (call before
        building a fleet over the block, e.g. on a reload)."""
        if self._mm is None:
            return
        (n,) = STATS_COUNT.unpack_from(self._mm, STATS_COUNT_OFFSET)
        if self.n_engines < n <= self.layout.max_engines:
            self._adopt(n)

    def _adopt(self, n_engines: int) -> None:
        ids = np.frombuffer(
            self._mm, dtype="<u8", count=n_engines, offset=self.layout.engine_ids_offset
        )
        self.n_engines = n_engines
        self.engine_ids = ids.copy()
        self.engine_ids.flags.writeable = False
        self._slot_of = {int(e): i for i, e in enumerate(self.engine_ids)}

    def __enter__(self) -> StatsBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- access --------------------------------------------------------------------

    def slot(self, engine_id: int) -> int:
        """The slot index of ``engine_id``; ``KeyError`` if the block has no such engine."""
        return self._slot_of[engine_id]

    def _offset(self, slot: int, field: Counter | Ewma, kind: type) -> int:
        if not 0 <= slot < self.n_engines:
            raise IndexError(f"slot {slot} out of range for {self.n_engines} engines")
        if type(field) is not kind:
            raise TypeError(f"expected a {kind.__name__} field, got {field!r}")
        return self._slots_offset + slot * STATS_SLOT_SIZE + field

    def add(self, slot: int, counter: Counter, delta: int = 1) -> int:
        """Atomically add ``delta`` to a counter; return its new value."""
        return self._atomic.add_i64(self._offset(slot, counter, Counter), delta)

    def get(self, slot: int, counter: Counter) -> int:
        """The current value of a counter."""
        return self._atomic.load_i64(self._offset(slot, counter, Counter))

    def observe(
        self, slot: int, ewma: Ewma, sample: float, alpha: float = DEFAULT_EWMA_ALPHA
    ) -> float:
        """Atomically fold ``sample`` into an EWMA; return its new value."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        return self._atomic.ewma_f64(self._offset(slot, ewma, Ewma), sample, alpha)

    def ewma(self, slot: int, ewma: Ewma) -> float:
        """The current value of an EWMA (NaN before its first sample)."""
        return self._atomic.load_f64(self._offset(slot, ewma, Ewma))

    def column(self, field: Counter | Ewma) -> np.ndarray:
        """A live, read-only, strided view of one field across engines.

        Counters are int64, EWMAs float64; usable directly as the ``loads`` argument
        of ``Selector.pick_bounded``. Values may change while you read them.
        """
        dtype = "<f8" if isinstance(field, Ewma) else "<i8"
        base = (
            np.frombuffer(
                self._mm,
                dtype=dtype,
                count=self.n_engines * STATS_SLOT_SIZE // 8,
                offset=self.layout.slots_offset,
            )
            if self.n_engines
            else np.empty(0, dtype=dtype)
        )
        view = base[int(field) // 8 :: STATS_SLOT_SIZE // 8]
        view.flags.writeable = False
        return view
