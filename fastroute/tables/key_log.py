"""The host's key log segment: the prefix keys every worker routes, for the others.

Each worker's ``prefix-hrw`` tables (hot groups, seen prefixes) would otherwise see only
the requests that worker routed (``fastroute._core.keylog_py`` says what that cost and
states the log's layout and protocol). The supervisor creates the segment
(``{stats_name}.keys``, :func:`key_log_name`) next to the stats block; each worker maps
it and gives it to its policies (:meth:`fastroute.policy.Policy.attach_key_log`), which
read and write it through the compiled core's ``KeyLog``.
"""

from __future__ import annotations

import os
import struct
from typing import Any

from fastroute._core.keylog_py import (
    ENTRY_WORDS,
    HEADER_WORDS,
    KEY_LOG_MAGIC,
    KEY_LOG_VERSION,
    init_key_log,
    key_log_size,
)
from fastroute.errors import (
    TableFormatError,
    TableSizeError,
    TableValueError,
    TableVersionError,
)
from fastroute.tables.segment import (
    WriterLock,
    close_mapping,
    create_segment,
    map_segment,
    open_existing,
    remove_segment,
    segment_path,
)

__all__ = ["DEFAULT_KEY_LOG_ENTRIES", "KeyLogSegment", "key_log_name"]

#: Entries of the log unless configured (``proxy.key_log_entries``): 536 bytes each.
DEFAULT_KEY_LOG_ENTRIES = 4096
#: Most entries a log may have (about 550 MB).
MAX_KEY_LOG_ENTRIES = 1 << 20
_HEADER = struct.Struct("<QQQQ")  # magic, version, capacity, entry words


def key_log_name(stats_name: str) -> str:
    """The segment name of the key log that goes with stats block ``stats_name``."""
    return f"{stats_name}.keys"


def check_entries(entries: int) -> None:
    """Raise :class:`~fastroute.errors.TableValueError` unless ``entries`` is a power of
    two from 16 to :data:`MAX_KEY_LOG_ENTRIES`."""
    if not 16 <= entries <= MAX_KEY_LOG_ENTRIES or entries & (entries - 1):
        raise TableValueError(
            f"key log entries must be a power of two from 16 to {MAX_KEY_LOG_ENTRIES}, "
            f"got {entries}"
        )


class KeyLogSegment:
    """A named shared-memory key log: :meth:`create` once per host (the supervisor),
    :meth:`attach` in each worker.

    Attributes
    ----------
    buffer : mmap.mmap
        The mapped log, for ``fastroute._core.KeyLog``.
    fd : int
        Its file (the pure-Python twin locks it for ``head++``).
    capacity : int
        Entries.
    """

    def __init__(
        self, mm: Any, fd: int, capacity: int, name: str, lock: WriterLock | None = None
    ) -> None:
        self.name = name
        self.buffer = mm
        self.fd = fd
        self.capacity = capacity
        self._lock = lock

    @classmethod
    def create(cls, name: str, entries: int = DEFAULT_KEY_LOG_ENTRIES) -> KeyLogSegment:
        """Create an empty named log (replacing an old one of that name).

        Raises
        ------
        fastroute.errors.TableLockedError
            Another live process owns the name.
        fastroute.errors.TableValueError
            ``entries`` is out of range (:func:`check_entries`).
        """
        check_entries(entries)
        fd, mm, lock = create_segment(
            name, key_log_size(entries), lambda mm: init_key_log(mm, entries)
        )
        return cls(mm, fd, entries, name, lock)

    @classmethod
    def attach(cls, name: str) -> KeyLogSegment:
        """Map the named log another process created.

        Raises
        ------
        fastroute.errors.TableNotFoundError, TableFormatError, TableVersionError,
        TableSizeError
        """
        fd = open_existing(segment_path(name), writable=True)
        try:
            header = os.pread(fd, 8 * HEADER_WORDS, 0)
            if len(header) < _HEADER.size:
                raise TableFormatError(f"segment {name!r} is not a fastroute key log")
            magic, version, capacity, entry_words = _HEADER.unpack_from(header)
            if magic != KEY_LOG_MAGIC:
                raise TableFormatError(f"segment {name!r} is not a fastroute key log")
            if version != KEY_LOG_VERSION or entry_words != ENTRY_WORDS:
                raise TableVersionError(
                    f"key log {name!r} has layout {version} with {entry_words}-word entries; "
                    f"this build reads {KEY_LOG_VERSION} with {ENTRY_WORDS}"
                )
            check_entries(capacity)
            size = os.fstat(fd).st_size
            if size < key_log_size(capacity):
                raise TableSizeError(f"key log {name!r} is {size} bytes, too short")
            mm = map_segment(fd, key_log_size(capacity), writable=True)
        except TableValueError as exc:
            os.close(fd)
            raise TableFormatError(f"key log {name!r}: {exc}") from exc
        except BaseException:
            os.close(fd)
            raise
        return cls(mm, fd, capacity, name)

    def close(self) -> None:
        """Unmap (every ``KeyLog`` over it must be released first); the creator also
        removes the named segment."""
        if self.buffer is None:
            return
        close_mapping(self.buffer)
        self.buffer = None
        os.close(self.fd)
        if self._lock is not None:
            remove_segment(self.name, self._lock)
            self._lock = None
