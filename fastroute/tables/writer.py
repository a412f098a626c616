"""The single writer of a shared-memory weight table (the controller, or a puller).

Tables are validated before publication (Envoy's "build tables off the hot path"),
by :meth:`TableSnapshot.validated`; readers only check the header and the generation.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from fastroute._core import AtomicBuffer
from fastroute.errors import (
    TableDimensionError,
    TableFencedError,
    TableFormatError,
    TableValueError,
)
from fastroute.tables.layout import (
    BUFFER_HEADER,
    GENERATION_OFFSET,
    HEADER,
    HEADER_SIZE,
    LAYOUT_VERSION,
    RETIRED_BIT,
    TABLE_MAGIC,
    BufferViews,
    TableLayout,
)
from fastroute.tables.segment import WriterLock, close_mapping, map_segment, segment_path
from fastroute.tables.snapshot import TableSnapshot

__all__ = ["TableWriter"]


class TableWriter:
    """Create (or take over) a named weight table and publish generations into it.

    Parameters
    ----------
    name : str
        Segment name (a file under ``fastroute.tables.segment.shm_dir()``).
    max_engines, max_classes : int
        Capacity of the segment; published tables may be smaller.
    mode : int
        File permissions of a newly created segment.

    Notes
    -----
    One writer per name, enforced with an ``flock`` that the kernel releases if the
    writer dies. A restarted writer reuses a compatible segment in place, so
    readers keep their mapping and generations keep increasing. An incompatible
    segment (other maxima or layout version) is replaced by a new file: the old
    one is marked retired first, and readers re-attach by name.

    Raises
    ------
    fastroute.errors.TableLockedError
        Another live writer owns the name.
    fastroute.errors.TableFormatError
        A file of that name exists and is not a fastroute table.
    """

    def __init__(
        self,
        name: str,
        max_engines: int = 4096,
        max_classes: int = 1024,
        *,
        mode: int = 0o600,
    ) -> None:
        self.layout = TableLayout(max_engines, max_classes)
        self.name = name
        self.path: Path = segment_path(name)
        self._mode = mode
        self._lock = WriterLock(self.path)
        try:
            self._mm, self._generation = self._open_or_create()
        except BaseException:
            self._lock.release()
            raise
        self._atomic = AtomicBuffer(self._mm, writable=True)
        self._views = (
            BufferViews(self._mm, self.layout, self.layout.buffer_offset(0)),
            BufferViews(self._mm, self.layout, self.layout.buffer_offset(1)),
        )
        #: The highest controller epoch (``meta["epoch"]``) this segment published; tables of a
        #: lower epoch are fenced off (:class:`TableFencedError`). None: none carried one.
        self.epoch: int | None = self._epoch_in_force()
        #: Tables refused by the epoch fence.
        self.fenced_total = 0

    def _epoch_in_force(self) -> int | None:
        """``meta["epoch"]`` of the generation in the segment (taken over), if any."""
        if self._generation == 0:
            return None
        base = self.layout.buffer_offset(self._generation & 1)
        fields = BUFFER_HEADER.unpack(self._mm[base : base + BUFFER_HEADER.size])
        meta_len = fields[-1]
        if not 0 < meta_len <= len(self._views[self._generation & 1].meta):
            return None
        raw = bytes(self._views[self._generation & 1].meta[:meta_len])
        try:
            epoch = msgspec.msgpack.decode(raw).get("epoch")
        except (msgspec.DecodeError, AttributeError):
            return None
        return epoch if isinstance(epoch, int) else None

    # -- segment life cycle -------------------------------------------------------

    def _open_or_create(self) -> tuple[Any, int]:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return self._create(start_generation=0)
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, HEADER.size, 0) if size >= HEADER_SIZE else b""
            magic = HEADER.unpack(head)[0] if head else 0
            if magic not in (0, TABLE_MAGIC):
                raise TableFormatError(
                    f"{self.path} exists and is not a fastroute weight table "
                    f"(magic {magic:#018x}, expected {TABLE_MAGIC:#018x}); remove it"
                )
            if magic == 0:  # a writer died while creating it
                return self._create(start_generation=0)
            _, version, _, max_e, max_c, *_ = HEADER.unpack(head)
            mm = map_segment(fd, size, writable=True)
            generation = int.from_bytes(mm[GENERATION_OFFSET : GENERATION_OFFSET + 8], "little")
            compatible = (
                version == LAYOUT_VERSION
                and (max_e, max_c) == (self.layout.max_engines, self.layout.max_classes)
                and size == self.layout.segment_size
                and not generation & RETIRED_BIT
            )
            if compatible:
                return mm, generation  # take over in place: readers keep their mapping
            start = generation & ~RETIRED_BIT if version == LAYOUT_VERSION else 0
            if version == LAYOUT_VERSION:
                retire = AtomicBuffer(mm, writable=True)
                retire.store_u64(GENERATION_OFFSET, generation | RETIRED_BIT)
                retire.release()
            mm.close()
            return self._create(start_generation=start)
        finally:
            os.close(fd)

    def _create(self, start_generation: int) -> tuple[Any, int]:
        # Build under a temporary name, then rename: readers never see a half-made file.
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, self._mode)
        try:
            os.ftruncate(fd, self.layout.segment_size)
            mm = map_segment(fd, self.layout.segment_size, writable=True)
        finally:
            os.close(fd)
        HEADER.pack_into(
            mm,
            0,
            0,  # magic last
            LAYOUT_VERSION,
            HEADER_SIZE,
            self.layout.max_engines,
            self.layout.max_classes,
            self.layout.buffer_size,
            self.layout.buffer_offset(0),
            time.time(),
            os.getpid(),
        )
        mm[GENERATION_OFFSET : GENERATION_OFFSET + 8] = start_generation.to_bytes(8, "little")
        mm[0:8] = TABLE_MAGIC.to_bytes(8, "little")
        os.rename(tmp, self.path)
        return mm, start_generation

    # -- publication ---------------------------------------------------------------

    @property
    def generation(self) -> int:
        """The last generation published (0 before the first publication)."""
        return self._generation

    def publish(
        self,
        engine_ids: Any,
        weights: Any,
        *,
        class_keys: Any = None,
        engine_flags: Any = None,
        shed_fraction: Any = None,
        retry_ratio: float | None = None,
        meta: dict[str, Any] | None = None,
    ) -> int:
        """Validate a table, stamp it with the next generation and the time, publish it.

        Arguments are those of :meth:`TableSnapshot.validated` (without ``generation``
        and ``published_at``). Returns the generation.

        Raises
        ------
        fastroute.errors.TableDimensionError
            Shapes disagree or exceed the segment's maxima.
        fastroute.errors.TableValueError
            A value is out of its domain.
        """
        snap = TableSnapshot.validated(
            self._generation + 1,
            engine_ids,
            weights,
            class_keys=class_keys,
            engine_flags=engine_flags,
            shed_fraction=shed_fraction,
            retry_ratio=retry_ratio,
            published_at=time.time(),
            meta=meta,
        )
        return self.write(snap)

    def write(self, snap: TableSnapshot) -> int:
        """Publish a validated snapshot as it is (its generation, time and checksum).

        Parameters
        ----------
        snap : TableSnapshot
            From :meth:`TableSnapshot.validated`; its generation must be the next one,
            ``self.generation + 1`` (the double buffer alternates by generation parity).

        Returns
        -------
        int
            The generation published.

        Raises
        ------
        fastroute.errors.TableDimensionError
            The table exceeds the segment's maxima.
        fastroute.errors.TableValueError
            The snapshot's generation is not the next one.
        """
        n_engines, n_classes = snap.n_engines, snap.n_classes
        if n_engines > self.layout.max_engines or n_classes > self.layout.max_classes:
            raise TableDimensionError(
                f"table is {n_classes} classes x {n_engines} engines; segment {self.name!r} "
                f"holds at most {self.layout.max_classes} x {self.layout.max_engines}"
            )
        generation = self._generation + 1
        if snap.generation != generation:
            raise TableValueError(
                f"segment {self.name!r} publishes generation {generation} next, "
                f"not {snap.generation}"
            )
        self._fence(snap)
        meta_bytes = snap.meta_bytes
        index = generation & 1
        base = self.layout.buffer_offset(index)
        views = self._views[index]
        views.engine_ids[:n_engines] = snap.engine_ids
        views.engine_flags[:n_engines] = snap.engine_flags
        views.class_keys[:n_classes] = snap.class_keys
        views.shed_fraction[:n_classes] = snap.shed_fraction
        views.meta[: len(meta_bytes)] = np.frombuffer(meta_bytes, dtype="u1")
        flat = snap.weights.reshape(-1)
        views.weights[: flat.shape[0]] = flat
        header = BUFFER_HEADER.pack(
            generation,
            n_engines,
            n_classes,
            snap.published_at,
            snap.retry_ratio,
            snap.checksum,
            len(meta_bytes),
        )
        self._mm[base : base + BUFFER_HEADER.size] = header
        # The release store publishes everything written above (seqlock writer side).
        self._atomic.store_u64(GENERATION_OFFSET, generation)
        self._generation = generation
        return generation

    def _fence(self, snap: TableSnapshot) -> None:
        """Refuse a table of an older controller epoch than the one in force (a deposed
        leader's); a table without an epoch (one controller, no HA) always passes."""
        epoch = snap.meta.get("epoch") if snap.meta_bytes else None
        if not isinstance(epoch, int):
            return
        if self.epoch is not None and epoch < self.epoch:
            self.fenced_total += 1
            raise TableFencedError(
                f"segment {self.name!r}: table of controller epoch {epoch} refused, "
                f"epoch {self.epoch} is in force"
            )
        self.epoch = epoch

    # -- teardown ------------------------------------------------------------------

    def close(self) -> None:
        """Stop writing; the segment stays for its readers."""
        self._release_mapping()
        self._lock.release()

    def _release_mapping(self) -> None:
        if self._mm is None:
            return
        self._atomic.release()
        self._views = ()  # drop the numpy views so that the mmap can close
        close_mapping(self._mm)
        self._mm = None

    def unlink(self) -> None:
        """Remove the segment and close; attached readers learn it from the retired bit."""
        if self._mm is not None:
            self._atomic.store_u64(GENERATION_OFFSET, self._generation | RETIRED_BIT)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self._release_mapping()
        self._lock.release(unlink=True)

    def __enter__(self) -> TableWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
