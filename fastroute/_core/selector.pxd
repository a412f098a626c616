from libc.stdint cimport int64_t, uint8_t, uint64_t


cdef class Selector:
    cdef readonly Py_ssize_t n_engines
    cdef readonly Py_ssize_t n_classes
    cdef object _engine_ids
    cdef object _weights
    cdef object _inv_w_arr
    cdef const double[:, ::1] _w        # weights, each row divided by its maximum
    cdef const double[:, ::1] _inv_w    # 1 / _w, +inf where the weight counts as zero
    cdef const uint64_t[::1] _seeds     # engine_seed(engine_id)
    cdef const uint64_t[::1] _ids

    cdef Py_ssize_t _pick(self, uint64_t key_hash, Py_ssize_t row,
                          const uint8_t* available) noexcept nogil
    cdef Py_ssize_t _rank(self, uint64_t key_hash, Py_ssize_t row, const uint8_t* available,
                          Py_ssize_t k, Py_ssize_t* out_idx, double* out_score) noexcept nogil
    cdef void _check_row(self, Py_ssize_t row) except *
    cdef Py_ssize_t _pick_masked(self, uint64_t key_hash, Py_ssize_t row,
                                 object available) except -2
    cdef object _rank_prefix(self, const uint64_t* keys, Py_ssize_t n_keys, Py_ssize_t row,
                             Py_ssize_t k, object loads, double c, object available)
