# The shared-buffer holder of shm.pyx, for the compiled modules that read a shared segment
# through raw pointers (prefix.pyx's KeyLog): one place owns the buffer's life cycle.

cdef class AtomicBuffer:
    cdef Py_buffer _view
    cdef bint _held
    cdef readonly bint writable
    cdef readonly Py_ssize_t size
    cdef char* _base

    cdef char* _at(self, Py_ssize_t offset, bint write) except NULL
