"""Atomic access to words of a shared-memory buffer: the pure-Python twin of ``shm.pyx``.

Loads and stores go through ``memoryview.cast`` views of 8-byte items, which CPython
copies with one 8-byte ``memcpy``: a single aligned machine load or store, never
torn. (``struct.pack_into`` is *not* usable here: it zero-fills the target before
writing, so a concurrent reader can see 0.) Read-modify-writes (``add_i64``,
``ewma_f64``) are serialised across processes with a POSIX byte-range lock on the
word (``fcntl.lockf`` on ``lock_fd``) and across threads of one process with a
``threading.Lock``, because POSIX record locks do not exclude threads of the same
process. Slower than the compiled atomics, same results. Native byte order, which
the table layout requires to be little-endian.
"""

from __future__ import annotations

import fcntl
import threading
from typing import Any

__all__ = ["AtomicBuffer"]


class AtomicBuffer:
    """Atomic 8-byte loads, stores and read-modify-writes on a shared buffer.

    Parameters
    ----------
    buffer : object supporting the buffer protocol
        Typically an ``mmap.mmap`` of a shared-memory file.
    writable : bool
        Whether stores and read-modify-writes are allowed.
    lock_fd : int, optional
        File descriptor of the shared file, locked around read-modify-writes.
        Required for ``add_i64`` and ``ewma_f64``.
    """

    def __init__(self, buffer: Any, writable: bool = False, lock_fd: int | None = None) -> None:
        view = memoryview(buffer)
        if writable and view.readonly:
            view.release()
            raise BufferError("Object is not writable.")
        raw = view.cast("B")
        words = raw[: len(raw) - len(raw) % 8]
        self._views: tuple[memoryview, ...] = (view, raw, words)
        self._u64 = words.cast("Q")
        self._i64 = words.cast("q")
        self._f64 = words.cast("d")
        self.writable = writable
        self.size = len(raw)
        self._released = False
        self._lock_fd = lock_fd
        self._thread_lock = threading.Lock()

    def release(self) -> None:
        """Release the underlying buffer (so that its mmap can be closed)."""
        if self._released:
            return
        for view in (self._u64, self._i64, self._f64, *reversed(self._views)):
            view.release()
        self._released = True
        self.size = 0

    def _index(self, offset: int, write: bool) -> int:
        if self._released:
            raise ValueError("AtomicBuffer has been released")
        if offset < 0 or offset + 8 > self.size or offset & 7:
            raise ValueError(
                f"offset {offset} is not an aligned 8-byte word inside {self.size} bytes"
            )
        if write and not self.writable:
            raise ValueError("AtomicBuffer is read-only")
        return offset >> 3

    def load_u64(self, offset: int) -> int:
        """Atomically load an unsigned 64-bit word."""
        return self._u64[self._index(offset, False)]

    def load_i64(self, offset: int) -> int:
        """Atomically load a signed 64-bit word."""
        return self._i64[self._index(offset, False)]

    def store_u64(self, offset: int, value: int) -> None:
        """Atomically store an unsigned 64-bit word."""
        self._u64[self._index(offset, True)] = value

    def load_f64(self, offset: int) -> float:
        """Atomically load a double."""
        return self._f64[self._index(offset, False)]

    def store_f64(self, offset: int, value: float) -> None:
        """Atomically store a double."""
        self._f64[self._index(offset, True)] = value

    def _locked(self, offset: int) -> _WordLock:
        if self._lock_fd is None:
            raise ValueError("the pure-Python AtomicBuffer needs lock_fd for read-modify-writes")
        return _WordLock(self._thread_lock, self._lock_fd, offset)

    def add_i64(self, offset: int, delta: int) -> int:
        """Atomically add ``delta`` to a signed 64-bit word; return the new value."""
        index = self._index(offset, True)
        with self._locked(offset):
            value = (self._i64[index] + delta + 2**63) % 2**64 - 2**63  # wraps like C int64
            self._i64[index] = value
        return value

    def ewma_f64(self, offset: int, sample: float, alpha: float) -> float:
        """Atomically fold ``sample`` into the EWMA at ``offset``; return the new value."""
        index = self._index(offset, True)
        with self._locked(offset):
            old = self._f64[index]
            new = sample if old != old else old + alpha * (sample - old)
            self._f64[index] = new
        return new

    def fence(self) -> None:
        """Full memory barrier (CPython's own locking already orders these accesses)."""


class _WordLock:
    """Thread lock plus a POSIX byte-range lock on one 8-byte word."""

    __slots__ = ("_thread_lock", "_fd", "_offset")

    def __init__(self, thread_lock: threading.Lock, fd: int, offset: int) -> None:
        self._thread_lock = thread_lock
        self._fd = fd
        self._offset = offset

    def __enter__(self) -> None:
        self._thread_lock.acquire()
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 8, self._offset)
        except BaseException:
            self._thread_lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 8, self._offset)
        finally:
            self._thread_lock.release()
