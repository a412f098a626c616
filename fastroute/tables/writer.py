"""The single writer of a shared-memory weight table (the controller, or a puller).

All validation happens here, before publication (Envoy's "build tables off the
hot path"): readers only check the header and the generation.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from fastroute._core import AtomicBuffer
from fastroute.errors import TableDimensionError, TableFormatError, TableValueError
from fastroute.tables.layout import (
    BUFFER_HEADER,
    GENERATION_OFFSET,
    HEADER,
    HEADER_SIZE,
    LAYOUT_VERSION,
    META_MAX_BYTES,
    RETIRED_BIT,
    TABLE_MAGIC,
    BufferViews,
    TableLayout,
    table_checksum,
)
from fastroute.tables.segment import WriterLock, close_mapping, map_segment, segment_path

__all__ = ["TableWriter", "DEFAULT_RETRY_RATIO"]

#: Retry budget ratio published when the caller gives none (algorithms.md §3).
DEFAULT_RETRY_RATIO = 0.1


def _as_array(value: Any, dtype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    arr = np.ascontiguousarray(value, dtype=dtype)
    if arr.shape != shape:
        raise TableDimensionError(f"{name} must have shape {shape}, got {arr.shape}")
    return arr


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
        """Validate and publish a table; return its generation.

        Parameters
        ----------
        engine_ids : array_like of uint64, shape (n_engines,)
            Stable engine ids, unique.
        weights : array_like of float64, shape (n_classes, n_engines)
            Finite, non-negative; zero means "never".
        class_keys : array_like of uint64, shape (n_classes,), optional
            Key of each class row (unique); default ``0 .. n_classes - 1``.
        engine_flags : array_like of uint8, shape (n_engines,), optional
            ``FLAG_UNAVAILABLE`` / ``FLAG_DRAINING`` bits; default 0.
        shed_fraction : array_like of float64, shape (n_classes,), optional
            Fraction of each class to shed, in [0, 1]; default 0.
        retry_ratio : float, optional
            Retry budget ratio in [0, 1]; default ``DEFAULT_RETRY_RATIO``.
        meta : dict, optional
            Free-form metadata (msgpack-encodable, at most ``META_MAX_BYTES``).

        Raises
        ------
        fastroute.errors.TableDimensionError
            Shapes disagree or exceed the segment's maxima.
        fastroute.errors.TableValueError
            A value is out of its domain.
        """
        ids = np.ascontiguousarray(engine_ids, dtype="<u8")
        if ids.ndim != 1:
            raise TableDimensionError(f"engine_ids must be 1-D, got shape {ids.shape}")
        n_engines = ids.shape[0]
        w = np.ascontiguousarray(weights, dtype="<f8")
        if w.ndim != 2 or w.shape[1] != n_engines:
            raise TableDimensionError(
                f"weights must have shape (n_classes, {n_engines}), got {w.shape}"
            )
        n_classes = w.shape[0]
        if n_engines > self.layout.max_engines or n_classes > self.layout.max_classes:
            raise TableDimensionError(
                f"table is {n_classes} classes x {n_engines} engines; segment {self.name!r} "
                f"holds at most {self.layout.max_classes} x {self.layout.max_engines}"
            )
        if len(np.unique(ids)) != n_engines:
            raise TableValueError("engine_ids must be unique")
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise TableValueError("weights must be finite and non-negative")
        keys = (
            np.arange(n_classes, dtype="<u8")
            if class_keys is None
            else _as_array(class_keys, "<u8", (n_classes,), "class_keys")
        )
        if len(np.unique(keys)) != n_classes:
            raise TableValueError("class_keys must be unique")
        flags = (
            np.zeros(n_engines, dtype="u1")
            if engine_flags is None
            else _as_array(engine_flags, "u1", (n_engines,), "engine_flags")
        )
        shed = (
            np.zeros(n_classes, dtype="<f8")
            if shed_fraction is None
            else _as_array(shed_fraction, "<f8", (n_classes,), "shed_fraction")
        )
        if not np.all((shed >= 0) & (shed <= 1)):
            raise TableValueError("shed_fraction must be in [0, 1]")
        ratio = DEFAULT_RETRY_RATIO if retry_ratio is None else float(retry_ratio)
        if not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
            raise TableValueError(f"retry_ratio must be in [0, 1], got {retry_ratio}")
        meta_bytes = b"" if meta is None else msgspec.msgpack.encode(meta)
        if len(meta_bytes) > META_MAX_BYTES:
            raise TableValueError(
                f"meta encodes to {len(meta_bytes)} bytes; at most {META_MAX_BYTES}"
            )

        generation = self._generation + 1
        index = generation & 1
        base = self.layout.buffer_offset(index)
        views = self._views[index]
        views.engine_ids[:n_engines] = ids
        views.engine_flags[:n_engines] = flags
        views.class_keys[:n_classes] = keys
        views.shed_fraction[:n_classes] = shed
        views.meta[: len(meta_bytes)] = np.frombuffer(meta_bytes, dtype="u1")
        flat = w.reshape(-1)
        views.weights[: flat.shape[0]] = flat
        published_at = time.time()
        checksum = table_checksum(
            generation, published_at, ratio, ids, flags, keys, shed, meta_bytes, flat
        )
        header = BUFFER_HEADER.pack(
            generation, n_engines, n_classes, published_at, ratio, checksum, len(meta_bytes)
        )
        self._mm[base : base + BUFFER_HEADER.size] = header
        # The release store publishes everything written above (seqlock writer side).
        self._atomic.store_u64(GENERATION_OFFSET, generation)
        self._generation = generation
        return generation

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
