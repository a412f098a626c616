# Atomic access to words of a shared-memory buffer (an mmap of a /dev/shm file).
# Spec: shm_py.py. The pure twin serialises read-modify-writes with a byte-range
# lock instead of CPU atomics; both give the same values.
cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t, uint64_t


cdef extern from "atomics.h" nogil:
    uint64_t fr_load_acquire_u64(const void *p)
    void fr_store_release_u64(void *p, uint64_t v)
    double fr_load_acquire_f64(const void *p)
    void fr_store_release_f64(void *p, double value)
    int64_t fr_add_fetch_i64(void *p, int64_t delta)
    void fr_fence()
    double fr_ewma_f64(void *p, double sample, double alpha)

__all__ = ["AtomicBuffer"]


@cython.final
cdef class AtomicBuffer:
    """Atomic 8-byte loads, stores and read-modify-writes on a shared buffer.

    Parameters
    ----------
    buffer : object supporting the buffer protocol
        Typically an ``mmap.mmap`` of a shared-memory file; held until :meth:`release`.
    writable : bool
        Request a writable buffer (required for stores and read-modify-writes).
    lock_fd : int, optional
        Ignored here; the pure-Python twin locks this file descriptor instead.

    Notes
    -----
    Offsets are in bytes and must be 8-byte aligned and inside the buffer.
    Memory order: loads acquire, stores release, read-modify-writes are
    sequentially consistent; :meth:`fence` is a full barrier (the seqlock reader
    calls it between copying a buffer and re-reading the generation).
    """

    def __cinit__(self, buffer, bint writable=False, lock_fd=None):
        PyObject_GetBuffer(buffer, &self._view, PyBUF_WRITABLE if writable else PyBUF_SIMPLE)
        self._held = True
        self.writable = writable
        self.size = self._view.len
        self._base = <char*>self._view.buf

    def __dealloc__(self):
        if self._held:
            PyBuffer_Release(&self._view)

    def release(self):
        """Release the underlying buffer (so that its mmap can be closed)."""
        if self._held:
            PyBuffer_Release(&self._view)
            self._held = False
            self._base = NULL
            self.size = 0

    cdef char* _at(self, Py_ssize_t offset, bint write) except NULL:
        if not self._held:
            raise ValueError("AtomicBuffer has been released")
        if offset < 0 or offset + 8 > self.size or offset & 7:
            raise ValueError(f"offset {offset} is not an aligned 8-byte word inside {self.size} bytes")
        if write and not self.writable:
            raise ValueError("AtomicBuffer is read-only")
        return self._base + offset

    def load_u64(self, Py_ssize_t offset):
        """Atomically load an unsigned 64-bit word (acquire)."""
        return fr_load_acquire_u64(self._at(offset, False))

    def load_i64(self, Py_ssize_t offset):
        """Atomically load a signed 64-bit word (acquire)."""
        return <int64_t>fr_load_acquire_u64(self._at(offset, False))

    def store_u64(self, Py_ssize_t offset, uint64_t value):
        """Atomically store an unsigned 64-bit word (release)."""
        fr_store_release_u64(self._at(offset, True), value)

    def add_i64(self, Py_ssize_t offset, int64_t delta):
        """Atomically add ``delta`` to a signed 64-bit word; return the new value."""
        return fr_add_fetch_i64(self._at(offset, True), delta)

    def load_f64(self, Py_ssize_t offset):
        """Atomically load a double (acquire)."""
        return fr_load_acquire_f64(self._at(offset, False))

    def store_f64(self, Py_ssize_t offset, double value):
        """Atomically store a double (release)."""
        fr_store_release_f64(self._at(offset, True), value)

    def ewma_f64(self, Py_ssize_t offset, double sample, double alpha):
        """Atomically fold ``sample`` into the EWMA at ``offset``; return the new value.

        ``new = old + alpha * (sample - old)``; a NaN slot (no sample yet) takes the
        sample as it is.
        """
        return fr_ewma_f64(self._at(offset, True), sample, alpha)

    def fence(self):
        """Full memory barrier."""
        fr_fence()
