"""Read-only access to a shared-memory weight table from any number of processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastroute._core import AtomicBuffer
from fastroute.errors import (
    TableDimensionError,
    TableEmptyError,
    TableError,
    TableFormatError,
    TableNotFoundError,
    TableSizeError,
    TableVersionError,
)
from fastroute.tables.layout import (
    BUFFER_HEADER,
    GENERATION_OFFSET,
    HARD_MAX_CLASSES,
    HARD_MAX_ENGINES,
    HEADER,
    HEADER_SIZE,
    LAYOUT_VERSION,
    META_MAX_BYTES,
    RETIRED_BIT,
    TABLE_MAGIC,
    BufferViews,
    TableLayout,
)
from fastroute.tables.segment import close_mapping, map_segment, open_existing, segment_path
from fastroute.tables.snapshot import TableSnapshot

__all__ = ["TableReader", "MAX_SNAPSHOT_ATTEMPTS"]

#: A snapshot is retried while the writer publishes during the copy; past this many
#: attempts ``snapshot()`` gives up (the writer would be publishing absurdly fast).
MAX_SNAPSHOT_ATTEMPTS = 1000


class TableReader:
    """Attach to a named weight table and take consistent snapshots of it.

    Parameters
    ----------
    name : str
        Segment name, as given to :class:`fastroute.tables.TableWriter`.
    verify : bool
        Recompute every snapshot's checksum and raise ``TableFormatError`` on a
        mismatch (costs a hash over the table; off by default).

    Notes
    -----
    Seqlock reader: load the generation (acquire), copy the buffer it names, fence,
    load the generation again; if it moved, the copy may be torn, so retry. The
    double buffer means the writer only ever overwrites the buffer a reader may be
    copying after publishing once more, which the second load detects.

    If the writer replaces the segment (the retired bit is set), the reader
    re-attaches by name on its next call. :meth:`reattach_if_replaced` also catches
    a segment deleted and re-created behind the reader's back.

    Raises
    ------
    fastroute.errors.TableNotFoundError
        No such segment, or it is not initialised yet.
    fastroute.errors.TableFormatError, TableVersionError, TableSizeError, TableDimensionError
        The segment is not a fastroute table, has another layout version, is shorter
        than its header requires, or declares dimensions over the hard maxima.
    """

    def __init__(self, name: str, *, verify: bool = False) -> None:
        self.name = name
        self.path: Path = segment_path(name)
        self.verify = verify
        self._mm: Any = None
        self._attach()

    def _attach(self) -> None:
        fd = open_existing(self.path, writable=False)
        try:
            stat = os.fstat(fd)
            if stat.st_size < HEADER_SIZE:
                if stat.st_size == 0:
                    raise TableNotFoundError(f"segment {self.name!r} is not initialised yet")
                raise TableSizeError(
                    f"segment {self.name!r} is {stat.st_size} bytes, shorter than the "
                    f"{HEADER_SIZE}-byte header"
                )
            (magic, version, header_size, max_e, max_c, buffer_size, buffer_offset, *_) = (
                HEADER.unpack(os.pread(fd, HEADER.size, 0))
            )
            if magic == 0:
                raise TableNotFoundError(f"segment {self.name!r} is not initialised yet")
            if magic != TABLE_MAGIC:
                raise TableFormatError(
                    f"segment {self.name!r} has magic {magic:#018x}, expected "
                    f"{TABLE_MAGIC:#018x}: it is not a fastroute weight table"
                )
            if version != LAYOUT_VERSION:
                raise TableVersionError(
                    f"segment {self.name!r} has layout version {version}; this fastroute "
                    f"reads version {LAYOUT_VERSION} (upgrade the older side)"
                )
            if not (1 <= max_e <= HARD_MAX_ENGINES and 1 <= max_c <= HARD_MAX_CLASSES):
                raise TableDimensionError(
                    f"segment {self.name!r} declares {max_c} classes x {max_e} engines; "
                    f"limits are {HARD_MAX_CLASSES} x {HARD_MAX_ENGINES}"
                )
            layout = TableLayout(max_e, max_c)
            if (header_size, buffer_size, buffer_offset) != (
                HEADER_SIZE,
                layout.buffer_size,
                layout.buffer_offset(0),
            ):
                raise TableFormatError(
                    f"segment {self.name!r} has an inconsistent header (header {header_size} "
                    f"bytes, buffers of {buffer_size} at {buffer_offset}; expected "
                    f"{HEADER_SIZE}, {layout.buffer_size} at {layout.buffer_offset(0)})"
                )
            if stat.st_size < layout.segment_size:
                raise TableSizeError(
                    f"segment {self.name!r} is {stat.st_size} bytes; its header requires "
                    f"{layout.segment_size}"
                )
            mm = map_segment(fd, layout.segment_size, writable=False)
        finally:
            os.close(fd)
        self._release()
        self.layout = layout
        self._inode = stat.st_ino
        self._mm = mm
        self._atomic = AtomicBuffer(mm, writable=False)
        self._load = self._atomic.load_u64
        self._views = (
            BufferViews(mm, layout, layout.buffer_offset(0)),
            BufferViews(mm, layout, layout.buffer_offset(1)),
        )

    def generation(self) -> int:
        """The current generation (0: nothing published yet); cheap, for polling."""
        generation = self._load(GENERATION_OFFSET)
        if generation & RETIRED_BIT:
            self._attach()
            generation = self._load(GENERATION_OFFSET)
        return generation

    def reattach_if_replaced(self) -> bool:
        """Re-attach if the name now refers to another file; return True if it did.

        Costs a ``stat``: call it from a periodic task, not per request.
        """
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            return False
        if inode == self._inode:
            return False
        self._attach()
        return True

    def snapshot(self) -> TableSnapshot:
        """Return a consistent copy of the current table.

        Raises
        ------
        fastroute.errors.TableEmptyError
            Nothing has been published yet.
        fastroute.errors.TableFormatError
            The buffer contradicts its generation, or (with ``verify``) its checksum.
        """
        load = self._load
        for _ in range(MAX_SNAPSHOT_ATTEMPTS):
            generation = load(GENERATION_OFFSET)
            if generation & RETIRED_BIT:
                self._attach()
                load = self._load
                continue
            if generation == 0:
                raise TableEmptyError(f"nothing has been published to {self.name!r} yet")
            index = generation & 1
            base = self.layout.buffer_offset(index)
            (buffer_gen, n_e, n_c, published_at, retry_ratio, checksum, meta_len) = (
                BUFFER_HEADER.unpack_from(self._mm, base)
            )
            sane = (
                buffer_gen == generation
                and n_e <= self.layout.max_engines
                and n_c <= self.layout.max_classes
                and meta_len <= META_MAX_BYTES
            )
            if sane:
                views = self._views[index]
                engine_ids = views.engine_ids[:n_e].copy()
                engine_flags = views.engine_flags[:n_e].copy()
                class_keys = views.class_keys[:n_c].copy()
                shed_fraction = views.shed_fraction[:n_c].copy()
                meta_bytes = views.meta[:meta_len].tobytes()
                weights = views.weights[: n_c * n_e].reshape(n_c, n_e).copy()
            self._atomic.fence()
            if load(GENERATION_OFFSET) != generation:
                continue  # the writer published during the copy: it may be torn
            if not sane:
                raise TableFormatError(
                    f"segment {self.name!r}: buffer {index} holds generation {buffer_gen} "
                    f"({n_c} x {n_e}) but the header says {generation}: corrupt segment"
                )
            for arr in (engine_ids, engine_flags, class_keys, shed_fraction, weights):
                arr.flags.writeable = False
            snap = TableSnapshot(
                generation=generation,
                engine_ids=engine_ids,
                engine_flags=engine_flags,
                class_keys=class_keys,
                weights=weights,
                shed_fraction=shed_fraction,
                retry_ratio=retry_ratio,
                published_at=published_at,
                meta_bytes=meta_bytes,
                checksum=checksum,
            )
            if self.verify and not snap.verify():
                raise TableFormatError(
                    f"segment {self.name!r}: checksum mismatch in generation {generation}"
                )
            return snap
        raise TableError(
            f"no consistent snapshot of {self.name!r} after {MAX_SNAPSHOT_ATTEMPTS} attempts: "
            "the writer publishes faster than a copy takes"
        )

    def _release(self) -> None:
        if self._mm is None:
            return
        self._atomic.release()
        self._views = ()
        close_mapping(self._mm)
        self._mm = None

    def close(self) -> None:
        """Detach from the segment."""
        self._release()

    def __enter__(self) -> TableReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
