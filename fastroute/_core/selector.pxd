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


cdef class TreeState


cdef const uint8_t[::1] _as_mask(object available, Py_ssize_t n)
cdef const uint8_t* _mask_ptr(const uint8_t[::1] mask) noexcept
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
    cdef dict _index_of                 # engine id -> table index
    cdef dict _trees                    # (row, mask bytes or None) -> TreeState
    cdef TreeState _last_tree           # the last tree found, for the identity fast path
    cdef Py_ssize_t _last_row

    cdef Py_ssize_t _pick(self, uint64_t key_hash, Py_ssize_t row,
                          const uint8_t* available) noexcept nogil
    cdef Py_ssize_t _rank(self, uint64_t key_hash, Py_ssize_t row, const uint8_t* available,
                          Py_ssize_t k, Py_ssize_t* out_idx, double* out_score) noexcept nogil
    cdef void _check_row(self, Py_ssize_t row) except *
    cdef Py_ssize_t _eligible_index(self, uint64_t engine_id, Py_ssize_t row,
                                    const uint8_t* mask)
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

    cdef TreeState _tree_for(self, Py_ssize_t row, object available, const uint8_t* mask)
    cdef TreeState _tree_slow(self, Py_ssize_t row, object available, const uint8_t* mask)
    cdef Py_ssize_t _descend(self, TreeState t, uint64_t key, Py_ssize_t row,
                             Py_ssize_t* path, Py_ssize_t* depth_out) noexcept nogil
    cdef int64_t _refresh(self, TreeState t, const int64_t[:] load) noexcept nogil
    cdef Py_ssize_t _tree_rank_c(self, TreeState t, uint64_t key, Py_ssize_t row,
                                 Py_ssize_t k, Py_ssize_t* out_idx, const int64_t[:] load,
                                 double total_w, double limit, int filtered,
                                 Py_ssize_t cap, bint probe, int64_t max_load=*,
                                 int64_t slack=*) except -1
    cdef Py_ssize_t _tree_rank_prefix_c(self, TreeState t, const uint64_t* keys,
                                        Py_ssize_t n_keys, Py_ssize_t row, Py_ssize_t k,
                                        const int64_t[:] load, double c, Py_ssize_t* out_idx,
                                        Py_ssize_t* used, int64_t home_slack=*) except -1
    cdef bint _tree_within_bound(self, TreeState t, Py_ssize_t i, Py_ssize_t row,
                                 const int64_t[:] load, double c, int64_t slack) noexcept nogil
    cdef Py_ssize_t _tree_least_loaded(self, TreeState t, uint64_t key, Py_ssize_t row,
                                       const int64_t[:] load) except -2


cdef class TreeState:
    # One (row, mask)'s trie (selector_tree.Tree) with its load chunks and the scratch
    # of a ranking (removed weight per node, removed engines).
    cdef readonly Py_ssize_t m
    cdef Py_ssize_t n_nodes
    cdef Py_ssize_t n_chunks
    cdef Py_ssize_t cursor
    cdef bint scanned
    cdef double total_w
    cdef object _tree               # keeps the arrays below alive
    cdef const int64_t[::1] order
    cdef const double[::1] node_w
    cdef const int64_t[::1] node_count
    cdef const uint64_t[::1] node_seed
    cdef const int64_t[::1] node_first
    cdef const int64_t[::1] node_n
    cdef const uint8_t[::1] node_bucket
    cdef double* removed_w
    cdef int64_t* removed_n
    cdef uint8_t* removed_e
    cdef int64_t* chunk_sum
    cdef int64_t* chunk_least
    cdef Py_ssize_t* chunk_ties     # SCAN_TIES per chunk
    cdef Py_ssize_t* chunk_n_ties
    cdef uint8_t* mask_copy         # the mask it was found by (NULL: no mask)
    cdef object mask_obj
