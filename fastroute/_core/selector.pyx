# Weighted rendezvous hashing, compiled. The spec is selector_py.py (module docstring
# there states the algorithm, its arithmetic and its references); any divergence
# between the two is a bug and tests/unit/test_selector.py checks parity.
cimport cython
from libc.math cimport INFINITY, log
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, qsort
from libc.string cimport memcmp, memcpy, memset

from fastroute._core.mix cimport engine_seed, mix64, unit_open

import numpy as np

from fastroute._core.selector_py import prepare_weights
from fastroute._core.selector_tree import (
    FANOUT_BITS,
    LEAF_CAP,
    LEAST_WALK,
    LOAD_CHUNK,
    MAX_DEPTH,
    NODE_SALT,
    TREE_CACHE,
    TREE_SALT,
    WALK_CAP,
    Tree,
)
from fastroute._core.selector_tree import SCAN_TIES as SPEC_SCAN_TIES

cdef Py_ssize_t LOAD_CHUNK_C = LOAD_CHUNK
cdef Py_ssize_t WALK_CAP_C = WALK_CAP
cdef Py_ssize_t LEAST_WALK_C = LEAST_WALK
cdef Py_ssize_t LEAF_CAP_C = LEAF_CAP
cdef Py_ssize_t MAX_DEPTH_C = MAX_DEPTH
cdef uint64_t TREE_SALT_C = TREE_SALT
cdef uint64_t NODE_SALT_C = NODE_SALT

__all__ = ["Selector"]


cdef inline bint _before(double s, uint64_t sid, double t, uint64_t tid) noexcept nogil:
    # Total order of the ranking: smaller score first, then smaller engine id.
    return s < t or (s == t and sid < tid)


cdef const uint8_t[::1] _as_mask(object available, Py_ssize_t n):
    # The eligibility mask as bytes, without a copy for bool and uint8 arrays; None for
    # None (every engine eligible).
    if available is None:
        return None
    if isinstance(available, np.ndarray) and available.dtype == np.bool_:
        available = available.view(np.uint8)
    cdef const uint8_t[::1] mask = available
    if mask.shape[0] != n:
        raise ValueError(f"available must have shape ({n},), got ({mask.shape[0]},)")
    return mask


cdef const uint8_t* _mask_ptr(const uint8_t[::1] mask) noexcept:
    # The mask's bytes, or NULL when there is none (None, or no engines): the C calls'
    # "every engine eligible". The caller holds the memoryview while the pointer is used.
    if mask is None or mask.shape[0] == 0:
        return NULL
    return &mask[0]


cdef const int64_t[:] _as_loads(object loads, Py_ssize_t n):
    # The load per engine as int64; int64 arrays (the stats block's strided column) need
    # no copy.
    cdef const int64_t[:] load
    try:
        load = loads
    except (TypeError, ValueError):
        load = np.asarray(loads, dtype=np.int64)
    if load.shape[0] != n:
        raise ValueError(f"loads must have shape ({n},), got ({load.shape[0]},)")
    return load


cdef inline Py_ssize_t _insert_top(Py_ssize_t i, double s, const uint64_t* ids, Py_ssize_t m,
                                   Py_ssize_t k, Py_ssize_t* out_idx,
                                   double* out_score) noexcept nogil:
    # Insert engine i of score s into the sorted top-k of m entries; the new count.
    cdef uint64_t sid = ids[i]
    cdef Py_ssize_t pos
    if m == k:
        if not _before(s, sid, out_score[m - 1], ids[out_idx[m - 1]]):
            return m
        m -= 1
    pos = m
    while pos > 0 and _before(s, sid, out_score[pos - 1], ids[out_idx[pos - 1]]):
        out_score[pos] = out_score[pos - 1]
        out_idx[pos] = out_idx[pos - 1]
        pos -= 1
    out_score[pos] = s
    out_idx[pos] = i
    return m + 1


@cython.final
cdef class Selector:
    """Weighted rendezvous-hashing engine selector over a weight table (compiled).

    Same API and same picks as ``fastroute._core.selector_py.Selector``, its spec.

    Parameters
    ----------
    engine_ids : sequence of int
        Stable unsigned 64-bit engine ids.
    weights : array_like, shape (n_classes, n_engines)
        One row per request class; non-negative and finite; zero means "never".
    """

    def __init__(self, engine_ids, weights):
        ids, w, inv_w = prepare_weights(engine_ids, weights)
        self.n_engines = ids.shape[0]
        self.n_classes = w.shape[0]
        seeds = np.empty(self.n_engines, dtype=np.uint64)
        cdef uint64_t[::1] seeds_view = seeds
        cdef const uint64_t[::1] ids_view = ids
        cdef Py_ssize_t i
        for i in range(self.n_engines):
            seeds_view[i] = engine_seed(ids_view[i])
        for arr in (ids, w, inv_w, seeds):
            arr.flags.writeable = False
        self._engine_ids = ids
        self._weights = w
        self._inv_w_arr = inv_w
        self._ids = ids
        self._w = w
        self._inv_w = inv_w
        self._seeds = seeds
        self._index_of = {int(engine): i for i, engine in enumerate(ids)}

    @property
    def engine_ids(self):
        """The engine ids, in table order (read-only)."""
        return self._engine_ids

    cdef Py_ssize_t _eligible_index(self, uint64_t engine_id, Py_ssize_t row,
                                    const uint8_t* mask):
        # The spec's eligible_index on a checked row and a raw mask (NULL: all).
        cdef object found = self._index_of.get(engine_id)
        if found is None:
            return -1
        cdef Py_ssize_t i = found
        if self._inv_w[row, i] == INFINITY or (mask != NULL and mask[i] == 0):
            return -1
        return i

    def eligible_index(self, uint64_t engine_id, Py_ssize_t row, available=None):
        """The table index of ``engine_id`` if it is eligible in ``row``, else -1 (see
        the spec)."""
        self._check_row(row)
        cdef const uint8_t[::1] mask = _as_mask(available, self.n_engines)
        cdef const uint8_t* mask_ptr = _mask_ptr(mask)
        return self._eligible_index(engine_id, row, mask_ptr)

    cdef Py_ssize_t _pick(self, uint64_t key_hash, Py_ssize_t row,
                          const uint8_t* available) noexcept nogil:
        cdef Py_ssize_t i, best_i = -1, n = self.n_engines
        cdef const double* inv_w = &self._inv_w[row, 0] if n else NULL
        cdef const uint64_t* seeds = &self._seeds[0] if n else NULL
        cdef double best = INFINITY, iw, u, s
        cdef uint64_t best_id = 0
        for i in range(n):
            iw = inv_w[i]
            if iw == INFINITY or (available != NULL and available[i] == 0):
                continue
            u = unit_open(mix64(key_hash ^ seeds[i]))
            if (1.0 - u) * iw > best:
                continue  # bound pruning: -ln u >= 1 - u, so this engine cannot win
            s = -log(u) * iw
            if best_i < 0 or _before(s, self._ids[i], best, best_id):
                best = s
                best_i = i
                best_id = self._ids[i]
        return best_i

    cdef Py_ssize_t _rank(self, uint64_t key_hash, Py_ssize_t row, const uint8_t* available,
                          Py_ssize_t k, Py_ssize_t* out_idx, double* out_score) noexcept nogil:
        # Insertion into a sorted top-k; prune against the k-th best score.
        cdef Py_ssize_t i, pos, m = 0, n = self.n_engines
        cdef const double* inv_w = &self._inv_w[row, 0] if n else NULL
        cdef const uint64_t* seeds = &self._seeds[0] if n else NULL
        cdef double threshold = INFINITY, iw, u, s
        cdef uint64_t sid
        for i in range(n):
            iw = inv_w[i]
            if iw == INFINITY or (available != NULL and available[i] == 0):
                continue
            u = unit_open(mix64(key_hash ^ seeds[i]))
            if (1.0 - u) * iw > threshold:
                continue
            s = -log(u) * iw
            sid = self._ids[i]
            if m == k:
                if not _before(s, sid, out_score[m - 1], self._ids[out_idx[m - 1]]):
                    continue
                m -= 1
            pos = m
            while pos > 0 and _before(s, sid, out_score[pos - 1], self._ids[out_idx[pos - 1]]):
                out_score[pos] = out_score[pos - 1]
                out_idx[pos] = out_idx[pos - 1]
                pos -= 1
            out_score[pos] = s
            out_idx[pos] = i
            m += 1
            if m == k:
                threshold = out_score[m - 1]
        return m

    cdef void _check_row(self, Py_ssize_t row) except *:
        if row < 0 or row >= self.n_classes:
            raise IndexError(f"row {row} out of range for {self.n_classes} classes")

    cdef Py_ssize_t _pick_masked(self, uint64_t key_hash, Py_ssize_t row,
                                 object available) except -2:
        # Kept apart from pick() so the unmasked call carries no memoryview locals.
        cdef const uint8_t[::1] mask = _as_mask(available, self.n_engines)
        return self._pick(key_hash, row, _mask_ptr(mask))

    def pick(self, uint64_t key_hash, Py_ssize_t row, available=None):
        """Return the engine index for ``key_hash`` in class ``row``, or -1 if none.

        Parameters
        ----------
        key_hash : int
            Unsigned 64-bit hash of the routing key.
        row : int
            Class row of the weight table.
        available : ndarray of bool or uint8, shape (n_engines,), optional
            Engines with a zero entry are skipped (ejected, unhealthy).
        """
        if row < 0 or row >= self.n_classes:
            self._check_row(row)
        if available is None:
            return self._pick(key_hash, row, NULL)
        return self._pick_masked(key_hash, row, available)

    def rank(self, uint64_t key_hash, Py_ssize_t row, Py_ssize_t k, available=None):
        """Return up to ``k`` engine indices in rendezvous (failover) order."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self._check_row(row)
        cdef const uint8_t[::1] mask = _as_mask(available, self.n_engines)
        cdef const uint8_t* mask_ptr = _mask_ptr(mask)
        if k > self.n_engines:
            k = self.n_engines
        if k == 0:
            return []
        cdef Py_ssize_t small_idx[8]
        cdef double small_score[8]
        cdef Py_ssize_t* out_idx = small_idx
        cdef double* out_score = small_score
        cdef Py_ssize_t m, j
        if k > 8:
            out_idx = <Py_ssize_t*>malloc(k * sizeof(Py_ssize_t))
            out_score = <double*>malloc(k * sizeof(double))
            if out_idx == NULL or out_score == NULL:
                free(out_idx)
                free(out_score)
                raise MemoryError()
        try:
            m = self._rank(key_hash, row, mask_ptr, k, out_idx, out_score)
            return [out_idx[j] for j in range(m)]
        finally:
            if k > 8:
                free(out_idx)
                free(out_score)

    def pick_bounded(self, uint64_t key_hash, Py_ssize_t row, loads,
                     double balance_factor=2.0, available=None):
        """Pick with a bounded-load guard; see the pure-Python spec for the rule."""
        if not balance_factor >= 1.0:
            raise ValueError(f"balance_factor must be >= 1, got {balance_factor}")
        self._check_row(row)
        cdef const uint8_t[::1] mask = _as_mask(available, self.n_engines)
        cdef const uint8_t* mask_ptr = _mask_ptr(mask)
        cdef const int64_t[:] load = _as_loads(loads, self.n_engines)
        cdef Py_ssize_t first = self._pick(key_hash, row, mask_ptr)
        if first < 0:
            return -1
        cdef LoadScan scan
        self._scan_rank(key_hash, row, mask_ptr, load, 0, NULL, NULL, &scan)
        cdef double scale = balance_factor * <double>(scan.total_load + 1) / scan.total_w
        if <double>(load[first] + 1) <= scale * self._w[row, first]:
            return first
        # The first within-bound engine of the ranking is the within-bound engine of
        # least (score, id): one pass, whatever the number of engines over the bound.
        cdef Py_ssize_t result
        with nogil:
            result = self._pick_within(key_hash, row, mask_ptr, load, scale)
        return first if result < 0 else result

    cdef Py_ssize_t _pick_within(self, uint64_t key_hash, Py_ssize_t row,
                                 const uint8_t* available, const int64_t[:] load,
                                 double scale) noexcept nogil:
        # _pick over the engines with load + 1 <= scale * w (pick_bounded's bound).
        cdef Py_ssize_t i, best_i = -1, n = self.n_engines
        cdef const double* w = &self._w[row, 0]
        cdef const double* inv_w = &self._inv_w[row, 0]
        cdef const uint64_t* ids = &self._ids[0]
        cdef double best = INFINITY, iw, u, s
        for i in range(n):
            iw = inv_w[i]
            if iw == INFINITY or (available != NULL and available[i] == 0):
                continue
            if not <double>(load[i] + 1) <= scale * w[i]:
                continue
            u = unit_open(mix64(key_hash ^ self._seeds[i]))
            if (1.0 - u) * iw > best:
                continue
            s = -log(u) * iw
            if best_i < 0 or _before(s, ids[i], best, ids[best_i]):
                best = s
                best_i = i
        return best_i

    cdef Py_ssize_t _scan_rank(self, uint64_t key_hash, Py_ssize_t row,
                               const uint8_t* available, const int64_t[:] load, Py_ssize_t k,
                               Py_ssize_t* out_idx, double* out_score,
                               LoadScan* scan) noexcept nogil:
        # One pass: the load totals and least load of the eligible engines and (k > 0)
        # the top-k ranking of key_hash, as _rank. Everything the loop reads or updates
        # is a local (no store through a pointer can alias it), so it stays in registers.
        cdef Py_ssize_t i, m = 0, n = self.n_engines, least_idx = -1, n_least = 0
        if n == 0:
            scan.total_w, scan.total_load, scan.least_load = 0.0, 0, 0
            scan.least_idx, scan.n_least = -1, 0
            return 0
        cdef const double* w = &self._w[row, 0]
        cdef const double* inv_w = &self._inv_w[row, 0]
        cdef const uint64_t* seeds = &self._seeds[0]
        cdef const uint64_t* ids = &self._ids[0]
        cdef const char* load_base = <const char*>&load[0]
        cdef Py_ssize_t load_stride = load.strides[0]
        cdef double threshold = INFINITY, iw, u, s, total_w = 0.0
        cdef int64_t total_load = 0, li, least = 0
        cdef Py_ssize_t ties[SCAN_TIES]
        for i in range(n):
            iw = inv_w[i]
            if iw == INFINITY or (available != NULL and available[i] == 0):
                continue
            li = (<const int64_t*>(load_base + i * load_stride))[0]
            total_w += w[i]
            total_load += li
            if least_idx < 0 or li < least:
                least = li
                least_idx = i
                n_least = 1
                ties[0] = i
            elif li == least:
                if n_least < SCAN_TIES:
                    ties[n_least] = i
                n_least += 1
            if k == 0:
                continue
            u = unit_open(mix64(key_hash ^ seeds[i]))
            if (1.0 - u) * iw > threshold:
                continue
            s = -log(u) * iw
            m = _insert_top(i, s, ids, m, k, out_idx, out_score)
            if m == k:
                threshold = out_score[m - 1]
        scan.total_w = total_w
        scan.total_load = total_load
        scan.least_load = least
        scan.least_idx = least_idx
        scan.n_least = n_least
        for i in range(min(n_least, SCAN_TIES)):
            scan.ties[i] = ties[i]
        return m

    cdef Py_ssize_t _rank_bounded(self, uint64_t key_hash, Py_ssize_t row,
                                  const uint8_t* available, const int64_t[:] load,
                                  double total_w, double limit, Py_ssize_t k,
                                  Py_ssize_t* out_idx, double* out_score) noexcept nogil:
        # _rank over the engines within rank_prefix's bound: load * W <= limit * w.
        cdef Py_ssize_t i, m = 0, n = self.n_engines
        cdef const double* w = &self._w[row, 0]
        cdef const double* inv_w = &self._inv_w[row, 0]
        cdef const uint64_t* ids = &self._ids[0]
        cdef double threshold = INFINITY, iw, u, s
        for i in range(n):
            iw = inv_w[i]
            if iw == INFINITY or (available != NULL and available[i] == 0):
                continue
            if not <double>load[i] * total_w <= limit * w[i]:
                continue
            u = unit_open(mix64(key_hash ^ self._seeds[i]))
            if (1.0 - u) * iw > threshold:
                continue
            s = -log(u) * iw
            m = _insert_top(i, s, ids, m, k, out_idx, out_score)
            if m == k:
                threshold = out_score[m - 1]
        return m

    cdef Py_ssize_t _rank_prefix_c(self, const uint64_t* keys, Py_ssize_t n_keys,
                                   Py_ssize_t row, Py_ssize_t k, const uint8_t* available,
                                   const int64_t[:] load, double c, Py_ssize_t* out_idx,
                                   double* out_score, Py_ssize_t* used,
                                   LoadScan* scan) noexcept nogil:
        # rank_prefix for 1 <= k <= n_engines and n_keys >= 1: the ranking's length, the
        # deciding key in used[0] (-1 when nothing is eligible) and the fleet's load scan.
        # The first key's ranking shares the pass that sums the loads.
        cdef Py_ssize_t j, e
        cdef Py_ssize_t m = self._scan_rank(keys[0], row, available, load, k, out_idx,
                                            out_score, scan)
        used[0] = -1
        if m == 0:
            return 0
        cdef const double* w = &self._w[row, 0]
        # Within bound iff load_e * W <= c * L * w_e (same arithmetic as the spec).
        cdef double limit = c * <double>scan.total_load
        cdef Py_ssize_t last = n_keys - 1, m_bounded = 0
        # The last key's ranking also yields its ranking over the engines within bound
        # (the fallback), in the same pass; off when the buffers cannot be had.
        cdef Py_ssize_t small_idx[8]
        cdef double small_score[8]
        cdef Py_ssize_t* b_idx = small_idx
        cdef double* b_score = small_score
        if k > 8:
            b_idx = <Py_ssize_t*>malloc(k * sizeof(Py_ssize_t))
            b_score = <double*>malloc(k * sizeof(double))
        cdef bint dual = last > 0 and b_idx != NULL and b_score != NULL
        for j in range(n_keys):
            if j == last and dual:
                m = self._rank_both(keys[j], row, available, load, scan.total_w, limit, k,
                                    out_idx, out_score, b_idx, b_score, &m_bounded)
            elif j > 0:
                m = self._rank(keys[j], row, available, k, out_idx, out_score)
            e = out_idx[0]
            if <double>load[e] * scan.total_w <= limit * w[e]:
                used[0] = j
                break
        if used[0] < 0:
            used[0] = n_keys
            if not dual:
                m = self._rank_bounded(keys[last], row, available, load, scan.total_w,
                                       limit, k, out_idx, out_score)
                if m == 0:
                    m = self._rank(keys[last], row, available, k, out_idx, out_score)
            elif m_bounded > 0:
                for j in range(m_bounded):
                    out_idx[j] = b_idx[j]
                    out_score[j] = b_score[j]
                m = m_bounded
            # (Else out_* hold the last key's ranking over the eligible engines: the
            # answer when rounding leaves no engine within bound.)
        if k > 8:
            free(b_idx)
            free(b_score)
        return m

    cdef Py_ssize_t _rank_both(self, uint64_t key_hash, Py_ssize_t row,
                               const uint8_t* available, const int64_t[:] load,
                               double total_w, double limit, Py_ssize_t k,
                               Py_ssize_t* out_idx, double* out_score, Py_ssize_t* b_idx,
                               double* b_score, Py_ssize_t* m_bounded) noexcept nogil:
        # _rank into out_* and _rank_bounded into b_* (its length in m_bounded), one pass.
        cdef Py_ssize_t i, m = 0, mb = 0, n = self.n_engines
        cdef const double* w = &self._w[row, 0]
        cdef const double* inv_w = &self._inv_w[row, 0]
        cdef const uint64_t* ids = &self._ids[0]
        cdef double threshold = INFINITY, b_threshold = INFINITY, iw, u, s, bound
        cdef bint within
        for i in range(n):
            iw = inv_w[i]
            if iw == INFINITY or (available != NULL and available[i] == 0):
                continue
            u = unit_open(mix64(key_hash ^ self._seeds[i]))
            bound = (1.0 - u) * iw
            within = <double>load[i] * total_w <= limit * w[i]
            if bound > threshold and (not within or bound > b_threshold):
                continue
            s = -log(u) * iw
            if not bound > threshold:
                m = _insert_top(i, s, ids, m, k, out_idx, out_score)
                if m == k:
                    threshold = out_score[m - 1]
            if within and not bound > b_threshold:
                mb = _insert_top(i, s, ids, mb, k, b_idx, b_score)
                if mb == k:
                    b_threshold = b_score[mb - 1]
        m_bounded[0] = mb
        return m

    cdef Py_ssize_t _least_loaded(self, uint64_t key_hash, Py_ssize_t row,
                                  const uint8_t* available, const int64_t[:] load,
                                  const LoadScan* scan) noexcept nogil:
        # least_loaded from a scan of the same loads: one engine of least load is the
        # answer; ties go by _pick over the tied engines.
        if scan.n_least <= 1:
            return scan.least_idx
        cdef Py_ssize_t i, j, best_i = -1, n = self.n_engines
        cdef const double* inv_w = &self._inv_w[row, 0]
        cdef const uint64_t* ids = &self._ids[0]
        cdef double best = INFINITY, iw, u, s
        cdef int64_t least = scan.least_load
        if scan.n_least <= SCAN_TIES:  # the scan kept every tie: no second pass
            for j in range(scan.n_least):
                i = scan.ties[j]
                s = -log(unit_open(mix64(key_hash ^ self._seeds[i]))) * inv_w[i]
                if best_i < 0 or _before(s, ids[i], best, ids[best_i]):
                    best = s
                    best_i = i
            return best_i
        for i in range(n):
            iw = inv_w[i]
            if iw == INFINITY or (available != NULL and available[i] == 0) or load[i] != least:
                continue
            u = unit_open(mix64(key_hash ^ self._seeds[i]))
            if (1.0 - u) * iw > best:
                continue
            s = -log(u) * iw
            if best_i < 0 or _before(s, ids[i], best, ids[best_i]):
                best = s
                best_i = i
        return best_i

    def rank_prefix(self, key_hashes, Py_ssize_t row, Py_ssize_t k, loads,
                    double balance_factor, available=None):
        """Rank by the first key whose home is within its bounded share; see the spec."""
        if not balance_factor >= 1.0:
            raise ValueError(f"balance_factor must be >= 1, got {balance_factor}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        cdef Py_ssize_t n_keys = len(key_hashes)
        if n_keys == 0:
            raise ValueError("key_hashes must not be empty")
        self._check_row(row)
        cdef uint64_t small_keys[16]
        cdef uint64_t* keys = small_keys
        memset(small_keys, 0, sizeof(small_keys))  # filled below; silences -Wmaybe-uninitialized
        if n_keys > 16:
            keys = <uint64_t*>malloc(n_keys * sizeof(uint64_t))
            if keys == NULL:
                raise MemoryError()
        cdef Py_ssize_t j
        try:
            for j in range(n_keys):
                keys[j] = key_hashes[j]  # OverflowError outside 64 bits, as pick()
            return self._rank_prefix(keys, n_keys, row, k, loads, balance_factor, available)
        finally:
            if n_keys > 16:
                free(keys)

    cdef object _rank_prefix(self, const uint64_t* keys, Py_ssize_t n_keys, Py_ssize_t row,
                             Py_ssize_t k, object loads, double c, object available):
        cdef Py_ssize_t n = self.n_engines
        cdef const uint8_t[::1] mask = _as_mask(available, n)
        cdef const uint8_t* mask_ptr = _mask_ptr(mask)
        cdef const int64_t[:] load = _as_loads(loads, n)
        if k > n:
            k = n
        if k == 0:
            return [], -1
        cdef Py_ssize_t small_idx[8]
        cdef double small_score[8]
        cdef Py_ssize_t* out_idx = small_idx
        cdef double* out_score = small_score
        if k > 8:
            out_idx = <Py_ssize_t*>malloc(k * sizeof(Py_ssize_t))
            out_score = <double*>malloc(k * sizeof(double))
            if out_idx == NULL or out_score == NULL:
                free(out_idx)
                free(out_score)
                raise MemoryError()
        cdef Py_ssize_t j, m, used
        cdef LoadScan scan
        try:
            m = self._rank_prefix_c(keys, n_keys, row, k, mask_ptr, load, c, out_idx,
                                    out_score, &used, &scan)
            if m == 0:
                return [], -1
            return [out_idx[j] for j in range(m)], used
        finally:
            if k > 8:
                free(out_idx)
                free(out_score)

    def least_loaded(self, uint64_t key_hash, Py_ssize_t row, loads, available=None):
        """The eligible engine of ``row`` with the smallest load, ties by rendezvous order
        of ``key_hash``; see the spec."""
        self._check_row(row)
        cdef Py_ssize_t n = self.n_engines
        cdef const uint8_t[::1] mask = _as_mask(available, n)
        cdef const uint8_t* mask_ptr = _mask_ptr(mask)
        cdef const int64_t[:] load = _as_loads(loads, n)
        cdef LoadScan scan
        self._scan_rank(0, row, mask_ptr, load, 0, NULL, NULL, &scan)
        return self._least_loaded(key_hash, row, mask_ptr, load, &scan)

    # -- hierarchical rendezvous (spec: selector_tree.py) ------------------------------

    cdef TreeState _tree_for(self, Py_ssize_t row, object available, const uint8_t* mask):
        # The tree of (row, mask contents): the last one found when the mask is the
        # same object with the same bytes (one memcmp), else by the contents.
        cdef TreeState t = self._last_tree
        if t is not None and row == self._last_row and available is t.mask_obj:
            if mask == NULL and t.mask_copy == NULL:
                return t
            if (mask != NULL and t.mask_copy != NULL
                    and memcmp(mask, t.mask_copy, self.n_engines) == 0):
                return t
        return self._tree_slow(row, available, mask)

    cdef TreeState _tree_slow(self, Py_ssize_t row, object available, const uint8_t* mask):
        cdef Py_ssize_t n = self.n_engines, i
        cdef bytearray contents
        cdef unsigned char* p
        if mask == NULL:
            key = (row, None)
        else:
            contents = bytearray(n)
            p = contents
            for i in range(n):
                p[i] = mask[i] != 0
            key = (row, bytes(contents))
        if self._trees is None:
            self._trees = {}
        cdef TreeState t = self._trees.get(key)
        if t is None:
            t = TreeState(_build_tree(self, row, mask), n, mask != NULL)
            if len(self._trees) >= TREE_CACHE:
                self._trees.clear()
            self._trees[key] = t
        if mask != NULL:
            memcpy(t.mask_copy, mask, n)
        t.mask_obj = available
        self._last_tree = t
        self._last_row = row
        return t

    cdef int64_t _refresh(self, TreeState t, const int64_t[:] load) noexcept nogil:
        # LoadChunks.refresh: one chunk re-read (every chunk on the tree's first call);
        # the total of the chunks' sums.
        cdef Py_ssize_t j
        if not t.scanned:
            for j in range(t.n_chunks):
                _scan_chunk(t, j, load)
            t.scanned = True
        elif t.n_chunks:
            _scan_chunk(t, t.cursor, load)
            t.cursor = (t.cursor + 1) % t.n_chunks
        return _chunk_total(t)

    cdef Py_ssize_t _tree_rank_c(self, TreeState t, uint64_t key, Py_ssize_t row,
                                 Py_ssize_t k, Py_ssize_t* out_idx, const int64_t[:] load,
                                 double total_w, double limit, int filtered,
                                 Py_ssize_t cap, bint probe, int64_t max_load=0,
                                 int64_t slack=0) except -1:
        # selector_tree.rank_tree: up to k engines (within bound when filtered) of the
        # key's tree ranking, walking at most cap positions (all when cap < 0). probe:
        # 0 (out_idx[0] set) if the first engine is not within bound (its load less
        # slack), else unfiltered.
        cdef Py_ssize_t walk = t.m if cap < 0 or cap > t.m else cap
        cdef Py_ssize_t small_e[_SMALL_WALK]
        cdef Py_ssize_t small_path[_SMALL_WALK * _PATH_CAP]
        cdef Py_ssize_t small_depth[_SMALL_WALK]
        cdef Py_ssize_t* rec_e = small_e
        cdef Py_ssize_t* rec_path = small_path
        cdef Py_ssize_t* rec_depth = small_depth
        if walk > _SMALL_WALK:
            rec_e = <Py_ssize_t*>malloc(walk * sizeof(Py_ssize_t))
            rec_path = <Py_ssize_t*>malloc(walk * _PATH_CAP * sizeof(Py_ssize_t))
            rec_depth = <Py_ssize_t*>malloc(walk * sizeof(Py_ssize_t))
            if rec_e == NULL or rec_path == NULL or rec_depth == NULL:
                free(rec_e)
                free(rec_path)
                free(rec_depth)
                raise MemoryError()
        cdef const double* w = &self._w[row, 0]
        cdef Py_ssize_t m = 0, tries = 0, a, j
        cdef Py_ssize_t* path
        # The GIL stays held: the ranking writes the tree's scratch (removed weights).
        while tries < walk and m < k:
            path = &rec_path[tries * _PATH_CAP]
            rec_e[tries] = self._descend(t, key, row, path, &rec_depth[tries])
            a = rec_e[tries]
            t.removed_e[a] = 1
            for j in range(rec_depth[tries] + 1):
                t.removed_w[path[j]] += w[a]
                t.removed_n[path[j]] += 1
            tries += 1
            if probe and tries == 1 and not <double>(load[a] - slack) * total_w <= limit * w[a]:
                out_idx[0] = a
                break
            if (filtered == _ANY
                    or (filtered == _WITHIN_BOUND and <double>load[a] * total_w <= limit * w[a])
                    or (filtered == _AT_MOST and load[a] <= max_load)):
                out_idx[m] = a
                m += 1
        for a in range(tries):
            t.removed_e[rec_e[a]] = 0
            for j in range(rec_depth[a] + 1):
                t.removed_w[rec_path[a * _PATH_CAP + j]] = 0.0
                t.removed_n[rec_path[a * _PATH_CAP + j]] = 0
        if walk > _SMALL_WALK:
            free(rec_e)
            free(rec_path)
            free(rec_depth)
        return m

    cdef Py_ssize_t _descend(self, TreeState t, uint64_t key, Py_ssize_t row,
                                    Py_ssize_t* path, Py_ssize_t* depth_out) noexcept nogil:
        # One descent past the removed engines; the engine, its nodes in path[0..depth].
        cdef Py_ssize_t q = 0, depth = 0, c, c_end, best_c, pos, i, best_i = -1
        cdef double best, wc, u, s, iw
        cdef const double* inv_w = &self._inv_w[row, 0]
        path[0] = 0
        while not t.node_bucket[q]:
            best = INFINITY
            best_c = -1
            c_end = t.node_first[q] + t.node_n[q]
            for c in range(t.node_first[q], c_end):
                if t.node_count[c] - t.removed_n[c] == 0:
                    continue
                wc = t.node_w[c] - t.removed_w[c]
                if not wc > 0.0:
                    wc = 5e-324
                u = unit_open(mix64(key ^ t.node_seed[c]))
                if (1.0 - u) / wc > best:
                    continue  # -ln u >= 1 - u: this child cannot win
                s = -log(u) / wc
                if best_c < 0 or s < best or (s == best and t.node_seed[c] < t.node_seed[best_c]):
                    best = s
                    best_c = c
            q = best_c
            depth += 1
            path[depth] = q
        best = INFINITY
        for pos in range(t.node_first[q], t.node_first[q] + t.node_n[q]):
            i = t.order[pos]
            if t.removed_e[i]:
                continue
            u = unit_open(mix64(key ^ self._seeds[i]))
            iw = inv_w[i]
            if (1.0 - u) * iw > best:
                continue
            s = -log(u) * iw
            if best_i < 0 or _before(s, self._ids[i], best, self._ids[best_i]):
                best = s
                best_i = i
        depth_out[0] = depth
        return best_i

    cdef Py_ssize_t _tree_rank_prefix_c(self, TreeState t, const uint64_t* keys,
                                        Py_ssize_t n_keys, Py_ssize_t row, Py_ssize_t k,
                                        const int64_t[:] load, double c, Py_ssize_t* out_idx,
                                        Py_ssize_t* used, int64_t home_slack=0) except -1:
        # tree_rank_prefix for k >= 1, n_keys >= 1: the ranking's length, the deciding
        # key in used[0] (-1 when nothing is eligible); the first key's home is within
        # bound with home_slack (the spec).
        used[0] = -1
        if t.m == 0:
            return 0
        cdef int64_t total_load = self._refresh(t, load)
        cdef double total_w = t.total_w, limit = c * <double>total_load
        cdef const double* w = &self._w[row, 0]
        cdef Py_ssize_t j, e, m
        for j in range(n_keys):
            # Probe: the ranking stops after its first engine unless that is within bound.
            m = self._tree_rank_c(t, keys[j], row, k, out_idx, load, total_w, limit, _ANY, -1,
                                  True, 0, home_slack if j == 0 else 0)
            if m > 0:
                used[0] = j
                return m
        used[0] = n_keys
        m = self._tree_rank_c(t, keys[n_keys - 1], row, k, out_idx, load, total_w, limit,
                              _WITHIN_BOUND, WALK_CAP_C, False)
        if m == 0:
            m = self._tree_rank_c(t, keys[n_keys - 1], row, k, out_idx, load, 0.0, 0.0, _ANY,
                                  -1, False)
        return m

    cdef bint _tree_within_bound(self, TreeState t, Py_ssize_t i, Py_ssize_t row,
                                 const int64_t[:] load, double c, int64_t slack) noexcept nogil:
        # tree_within_bound: the load total as of the tree's last refresh (LoadChunks.total).
        cdef int64_t total = _chunk_total(t) if t.scanned else self._refresh(t, load)
        cdef double limit = c * <double>total
        return <double>(load[i] - slack) * t.total_w <= limit * self._w[row, i]

    def tree_within_bound(self, Py_ssize_t index, Py_ssize_t row, loads, double balance_factor,
                          available=None, int64_t slack=0):
        """Whether engine ``index`` is within the load bound, its load less ``slack`` (see
        the spec)."""
        self._check_row(row)
        if not 0 <= index < self.n_engines:
            raise IndexError(f"engine index {index} out of range for {self.n_engines}")
        cdef const uint8_t[::1] mask = _as_mask(available, self.n_engines)
        cdef const uint8_t* mask_ptr = _mask_ptr(mask)
        cdef const int64_t[:] load = _as_loads(loads, self.n_engines)
        cdef TreeState t = self._tree_for(row, available, mask_ptr)
        return self._tree_within_bound(t, index, row, load, balance_factor, slack)

    cdef Py_ssize_t _tree_least_loaded(self, TreeState t, uint64_t key, Py_ssize_t row,
                                       const int64_t[:] load) except -2:
        # tree_least_loaded: the least live load among the chunks' least-load engines
        # (ties by flat rendezvous score), or with SCAN_TIES or more ties there the first
        # of the key's LEAST_WALK ranked engines at most as loaded, if any.
        if not t.scanned:
            self._refresh(t, load)
        cdef const double* inv_w = &self._inv_w[row, 0]
        cdef Py_ssize_t j, a, i, best_i = -1, n_at = 0
        cdef int64_t li, best_load = 0
        cdef double best = INFINITY, s
        for j in range(t.n_chunks):
            for a in range(t.chunk_n_ties[j]):
                i = t.chunk_ties[j * SCAN_TIES + a]
                li = load[i]
                if best_i >= 0 and li > best_load:
                    continue
                n_at = 1 if best_i < 0 or li < best_load else n_at + 1
                s = -log(unit_open(mix64(key ^ self._seeds[i]))) * inv_w[i]
                if (best_i < 0 or li < best_load or s < best
                        or (s == best and self._ids[i] < self._ids[best_i])):
                    best_i = i
                    best_load = li
                    best = s
        cdef Py_ssize_t walked[_SMALL_WALK]
        if n_at >= SCAN_TIES and self._tree_rank_c(t, key, row, 1, walked, load, 0.0, 0.0, _AT_MOST,
                                             LEAST_WALK_C, False, best_load) > 0:
            return walked[0]
        return best_i

    def tree_size(self, Py_ssize_t row, available=None):
        """How many engines of ``row`` are eligible (weight > 0, not masked out)."""
        self._check_row(row)
        cdef const uint8_t[::1] mask = _as_mask(available, self.n_engines)
        cdef const uint8_t* mask_ptr = _mask_ptr(mask)
        return self._tree_for(row, available, mask_ptr).m

    def tree_rank(self, uint64_t key_hash, Py_ssize_t row, Py_ssize_t k, available=None):
        """Up to ``k`` engine indices in hierarchical rendezvous order; see the spec."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self._check_row(row)
        cdef const uint8_t[::1] mask = _as_mask(available, self.n_engines)
        cdef const uint8_t* mask_ptr = _mask_ptr(mask)
        cdef TreeState t = self._tree_for(row, available, mask_ptr)
        if k > t.m:
            k = t.m
        if k == 0:
            return []
        cdef Py_ssize_t* out_idx = <Py_ssize_t*>malloc(k * sizeof(Py_ssize_t))
        if out_idx == NULL:
            raise MemoryError()
        cdef const int64_t[:] no_load = _NO_LOAD
        cdef Py_ssize_t m, j
        try:
            m = self._tree_rank_c(t, key_hash, row, k, out_idx, no_load, 0.0, 0.0, _ANY, -1,
                                  False)
            return [out_idx[j] for j in range(m)]
        finally:
            free(out_idx)

    def tree_rank_prefix(self, key_hashes, Py_ssize_t row, Py_ssize_t k, loads,
                         double balance_factor, available=None, int64_t home_slack=0):
        """rank_prefix on the tree ranking with bounded-staleness load totals; see the
        spec."""
        if not balance_factor >= 1.0:
            raise ValueError(f"balance_factor must be >= 1, got {balance_factor}")
        if home_slack < 0:
            raise ValueError(f"home_slack must be >= 0, got {home_slack}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        cdef Py_ssize_t n_keys = len(key_hashes), j, m, used
        if n_keys == 0:
            raise ValueError("key_hashes must not be empty")
        self._check_row(row)
        cdef uint64_t* keys = <uint64_t*>malloc(n_keys * sizeof(uint64_t))
        cdef Py_ssize_t* out_idx = NULL
        if keys == NULL:
            raise MemoryError()
        cdef const uint8_t[::1] mask
        cdef const uint8_t* mask_ptr = NULL
        try:
            for j in range(n_keys):
                keys[j] = key_hashes[j]
            mask = _as_mask(available, self.n_engines)
            mask_ptr = _mask_ptr(mask)
            load = _as_loads(loads, self.n_engines)
            t = self._tree_for(row, available, mask_ptr)
            k = min(k, max(t.m, 1))
            out_idx = <Py_ssize_t*>malloc(k * sizeof(Py_ssize_t))
            if out_idx == NULL:
                raise MemoryError()
            m = self._tree_rank_prefix_c(t, keys, n_keys, row, k, load, balance_factor,
                                         out_idx, &used, home_slack)
            if m == 0:
                return [], -1
            return [out_idx[j] for j in range(m)], used
        finally:
            free(keys)
            free(out_idx)

    def tree_least_loaded(self, uint64_t key_hash, Py_ssize_t row, loads, available=None):
        """The least live load among the load chunks' least-load engines; see the spec."""
        self._check_row(row)
        cdef const uint8_t[::1] mask = _as_mask(available, self.n_engines)
        cdef const uint8_t* mask_ptr = _mask_ptr(mask)
        cdef const int64_t[:] load = _as_loads(loads, self.n_engines)
        cdef TreeState t = self._tree_for(row, available, mask_ptr)
        return self._tree_least_loaded(t, key_hash, row, load)


cdef enum:
    _ANY = 0            # _tree_rank_c's filters: none,
    _WITHIN_BOUND = 1   # load * total_w <= limit * w,
    _AT_MOST = 2        # load <= max_load

cdef enum:
    _SMALL_WALK = 8     # rankings walking up to this many positions need no allocation
    _PATH_CAP = 17      # nodes on a path: the root and MAX_DEPTH levels

if (_PATH_CAP != MAX_DEPTH + 1 or SCAN_TIES != SPEC_SCAN_TIES
        or LEAST_WALK_C > _SMALL_WALK or FANOUT_BITS != 4):
    raise ImportError("fastroute._core.selector was built against other selector_tree limits")

cdef object _NO_LOAD = np.zeros(1, dtype=np.int64)


cdef inline int64_t _chunk_total(TreeState t) noexcept nogil:
    # The sum of the chunks' load sums as of their last scan.
    cdef int64_t total = 0
    cdef Py_ssize_t j
    for j in range(t.n_chunks):
        total += t.chunk_sum[j]
    return total


cdef inline void _scan_chunk(TreeState t, Py_ssize_t j, const int64_t[:] load) noexcept nogil:
    # LoadChunks._scan: the sum, least load and first SCAN_TIES engines at it of chunk j.
    cdef Py_ssize_t pos, i, n_ties = 0, stop = min((j + 1) * LOAD_CHUNK_C, t.m)
    cdef int64_t total = 0, least = 0, li
    cdef Py_ssize_t* ties = &t.chunk_ties[j * SCAN_TIES]
    for pos in range(j * LOAD_CHUNK_C, stop):
        i = t.order[pos]
        li = load[i]
        total += li
        if n_ties == 0 or li < least:
            least = li
            ties[0] = i
            n_ties = 1
        elif li == least and n_ties < SCAN_TIES:
            ties[n_ties] = i
            n_ties += 1
    t.chunk_sum[j] = total
    t.chunk_least[j] = least
    t.chunk_n_ties[j] = n_ties


@cython.final
cdef class TreeState:
    """One (row, mask)'s trie with its load chunks (internal to the selector)."""

    def __cinit__(self, tree, Py_ssize_t n_engines, bint masked):
        self._tree = tree
        self.m = tree.m
        self.order = tree.order
        self.node_w = tree.node_w
        self.node_count = tree.node_count
        self.node_seed = tree.node_seed
        self.node_first = tree.node_first
        self.node_n = tree.node_n
        self.node_bucket = tree.node_bucket
        self.n_nodes = tree.node_w.shape[0]
        self.total_w = tree.total_w
        self.n_chunks = tree.n_chunks
        cdef Py_ssize_t nodes = max(self.n_nodes, 1), chunks = max(self.n_chunks, 1)
        self.removed_w = <double*>calloc(nodes, sizeof(double))
        self.removed_n = <int64_t*>calloc(nodes, sizeof(int64_t))
        self.removed_e = <uint8_t*>calloc(max(n_engines, 1), sizeof(uint8_t))
        self.chunk_sum = <int64_t*>calloc(chunks, sizeof(int64_t))
        self.chunk_least = <int64_t*>calloc(chunks, sizeof(int64_t))
        self.chunk_ties = <Py_ssize_t*>calloc(chunks * SCAN_TIES, sizeof(Py_ssize_t))
        self.chunk_n_ties = <Py_ssize_t*>calloc(chunks, sizeof(Py_ssize_t))
        self.mask_copy = <uint8_t*>calloc(max(n_engines, 1), 1) if masked else NULL
        if (self.removed_w == NULL or self.removed_n == NULL or self.removed_e == NULL
                or self.chunk_sum == NULL or self.chunk_least == NULL
                or self.chunk_ties == NULL or self.chunk_n_ties == NULL
                or (masked and self.mask_copy == NULL)):
            raise MemoryError()

    def __dealloc__(self):
        free(self.removed_w)
        free(self.removed_n)
        free(self.removed_e)
        free(self.chunk_sum)
        free(self.chunk_least)
        free(self.chunk_ties)
        free(self.chunk_n_ties)
        free(self.mask_copy)


cdef struct _PathIdx:
    uint64_t path
    Py_ssize_t idx


cdef int _compare_paths(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const _PathIdx*>a).path, y = (<const _PathIdx*>b).path
    return (x > y) - (x < y)


cdef object _build_tree(Selector sel, Py_ssize_t row, const uint8_t* mask):
    # selector_tree.build_tree, the same tree bit for bit (tests/unit/test_selector_tree.py),
    # with the per-engine work in C: the trie is rebuilt whenever a row's mask changes.
    cdef Py_ssize_t n = sel.n_engines, i, m = 0, q, pos, end, start, stop, depth, c
    cdef const double* w = &sel._w[row, 0] if n else NULL
    cdef const double* inv_w = &sel._inv_w[row, 0] if n else NULL
    cdef uint64_t prefix, digit, child
    cdef int shift
    cdef double total
    cdef _PathIdx* pairs = <_PathIdx*>malloc(max(n, 1) * sizeof(_PathIdx))
    if pairs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            if inv_w[i] != INFINITY and (mask == NULL or mask[i] != 0):
                pairs[m].path = mix64(sel._seeds[i] ^ TREE_SALT_C)
                pairs[m].idx = i
                m += 1
        qsort(pairs, m, sizeof(_PathIdx), _compare_paths)
        order = np.empty(m, dtype=np.int64)
        for i in range(m):
            order[i] = pairs[i].idx
        # Per node: [W, count, seed, first, n, bucket] and its [start, stop, depth, prefix].
        nodes = []
        spans = []
        if m:
            nodes.append([0.0, m, 0, 0, 0, 0])
            spans.append((0, m, 0, 0))
        q = 0
        while q < len(nodes):
            start, stop, depth, prefix = spans[q]
            node = nodes[q]
            if stop - start <= LEAF_CAP_C or depth == MAX_DEPTH_C:
                total = 0.0
                for pos in range(start, stop):
                    total += w[pairs[pos].idx]
                node[0], node[3], node[4], node[5] = total, start, stop - start, 1
            else:
                shift = 64 - 4 * (depth + 1)
                node[3] = len(nodes)
                pos = start
                while pos < stop:
                    digit = (pairs[pos].path >> shift) & 15
                    end = pos
                    while end < stop and ((pairs[end].path >> shift) & 15) == digit:
                        end += 1
                    child = (prefix << 4) | digit
                    nodes.append([0.0, end - pos,
                                  mix64(child ^ mix64(<uint64_t>(depth + 1) ^ NODE_SALT_C)),
                                  0, 0, 0])
                    spans.append((pos, end, depth + 1, child))
                    pos = end
                node[4] = len(nodes) - node[3]
            q += 1
        for q in range(len(nodes) - 1, -1, -1):
            node = nodes[q]
            if not node[5]:
                total = 0.0
                for c in range(node[3], node[3] + node[4]):
                    total += <double>nodes[c][0]
                node[0] = total
        return Tree.from_arrays(order, nodes)
    finally:
        free(pairs)
