from libc.stdint cimport int64_t, uint8_t, uint64_t


cdef enum:
    SCAN_TIES = 8  # ties at the least load a LoadScan keeps


cdef struct LoadScan:
    # The eligible engines of a row under one load array (Selector._scan_rank).
    double total_w          # sum of their normalised weights
    int64_t total_load      # sum of their loads
    int64_t least_load      # their least load
    Py_ssize_t least_idx    # the first of them (table order) at least_load; -1 if none
    Py_ssize_t n_least      # how many of them are at least_load
    Py_ssize_t ties[SCAN_TIES]  # the first of those (all when n_least <= SCAN_TIES)


cdef const uint8_t[::1] _as_mask(object available, Py_ssize_t n)
cdef const int64_t[:] _as_loads(object loads, Py_ssize_t n)


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
    cdef Py_ssize_t _pick_within(self, uint64_t key_hash, Py_ssize_t row,
                                 const uint8_t* available, const int64_t[:] load,
                                 double scale) noexcept nogil
    cdef Py_ssize_t _scan_rank(self, uint64_t key_hash, Py_ssize_t row,
                               const uint8_t* available, const int64_t[:] load, Py_ssize_t k,
                               Py_ssize_t* out_idx, double* out_score,
                               LoadScan* scan) noexcept nogil
    cdef Py_ssize_t _rank_bounded(self, uint64_t key_hash, Py_ssize_t row,
                                  const uint8_t* available, const int64_t[:] load,
                                  double total_w, double limit, Py_ssize_t k,
                                  Py_ssize_t* out_idx, double* out_score) noexcept nogil
    cdef Py_ssize_t _rank_prefix_c(self, const uint64_t* keys, Py_ssize_t n_keys,
                                   Py_ssize_t row, Py_ssize_t k, const uint8_t* available,
                                   const int64_t[:] load, double c, Py_ssize_t* out_idx,
                                   double* out_score, Py_ssize_t* used,
                                   LoadScan* scan) noexcept nogil
    cdef Py_ssize_t _rank_both(self, uint64_t key_hash, Py_ssize_t row,
                               const uint8_t* available, const int64_t[:] load,
                               double total_w, double limit, Py_ssize_t k,
                               Py_ssize_t* out_idx, double* out_score, Py_ssize_t* b_idx,
                               double* b_score, Py_ssize_t* m_bounded) noexcept nogil
    cdef Py_ssize_t _least_loaded(self, uint64_t key_hash, Py_ssize_t row,
                                  const uint8_t* available, const int64_t[:] load,
                                  const LoadScan* scan) noexcept nogil
