"""Named shared-memory segments: files under ``/dev/shm`` mapped with ``mmap``.

We use plain files rather than ``multiprocessing.shared_memory`` because its
resource tracker unlinks (or warns about) segments that another process owns;
here the writer alone decides when a segment goes away.

The directory is ``$FASTROUTE_SHM_DIR`` if set, else ``/dev/shm`` (tmpfs: memory,
never disk), else the system temporary directory.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from fastroute.errors import TableLockedError, TableNotFoundError

__all__ = [
    "shm_dir",
    "segment_path",
    "map_segment",
    "close_mapping",
    "open_existing",
    "WriterLock",
    "lock_path",
    "validate_name",
    "create_segment",
    "remove_segment",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def shm_dir() -> Path:
    """The directory that holds fastroute's segments."""
    configured = os.environ.get("FASTROUTE_SHM_DIR")
    if configured:
        return Path(configured)
    dev_shm = Path("/dev/shm")
    if dev_shm.is_dir() and os.access(dev_shm, os.W_OK):
        return dev_shm
    return Path(tempfile.gettempdir())


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid segment name, else raise ``ValueError``."""
    if not _NAME.match(name) or name.endswith((".lock", ".tmp")):
        raise ValueError(
            f"invalid segment name {name!r}: use letters, digits, '.', '_' or '-' "
            "(no '/'; not ending in .lock or .tmp), at most 201 characters"
        )
    return name


def segment_path(name: str) -> Path:
    """The file backing segment ``name``."""
    return shm_dir() / validate_name(name)


def map_segment(fd: int, size: int, *, writable: bool) -> mmap.mmap:
    """Map ``size`` bytes of the open file ``fd``, shared between processes."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)


def create_segment(
    name: str, size: int, init: Callable[[mmap.mmap], None], *, mode: int = 0o600
) -> tuple[int, mmap.mmap, WriterLock]:
    """Create segment ``name`` of ``size`` zeroed bytes, replacing an old one of that name.

    Under a fresh :class:`WriterLock`, the file is made as ``<name>.tmp``, mapped, filled by
    ``init`` (its header, the magic last) and renamed into place, so a reader never maps a
    half-made segment. Returns ``(fd, mapping, lock)``; the caller owns all three.

    Raises
    ------
    fastroute.errors.TableLockedError
        Another live process owns the name.
    """
    path = segment_path(name)
    lock = WriterLock(path)
    try:
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.ftruncate(fd, size)
            mm = map_segment(fd, size, writable=True)
            init(mm)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        lock.release()
        raise
    return fd, mm, lock


def remove_segment(name: str, lock: WriterLock) -> None:
    """The creator's end of segment ``name``: remove its file, then its lock (and file)."""
    segment_path(name).unlink(missing_ok=True)
    lock.release(unlink=True)


def close_mapping(mm: mmap.mmap) -> None:
    """Unmap ``mm`` now, or, if numpy views handed out still use it, when they die."""
    try:
        mm.close()
    except BufferError:
        pass  # exported views keep the mapping alive; it is unmapped with the last one


def open_existing(path: Path, *, writable: bool) -> int:
    """Open the file of an existing segment, or raise :class:`TableNotFoundError`."""
    try:
        return os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise TableNotFoundError(
            f"no shared-memory segment {path.name!r} in {path.parent} (has its writer started?)"
        ) from None


def lock_path(path: Path) -> Path:
    """The lock file of :class:`WriterLock` ``(path)``: ``<path>.lock``."""
    return path.with_name(path.name + ".lock")


class WriterLock:
    """Exclusive, crash-safe ownership of a segment name by one writer process.

    An ``flock`` on ``<name>.lock``: the kernel drops it when the owner dies, so a
    restarted writer can take over without manual clean-up.
    """

    def __init__(self, path: Path) -> None:
        self.path = lock_path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise TableLockedError(
                    f"segment {path.name!r} is owned by another live writer "
                    f"(lock {self.path} is held)"
                ) from None
            raise

    def release(self, *, unlink: bool = False) -> None:
        """Drop the lock; with ``unlink``, remove the lock file too."""
        if self._fd < 0:
            return
        if unlink:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = -1
