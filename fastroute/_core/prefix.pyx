# The prefix-hrw decision, compiled. The spec is prefix_py.py (its module docstring states
# the share arithmetic and the pruning rule); any divergence between the two is a bug and
# tests/unit/test_prefix_core.py checks parity.
cimport cython
from cpython.buffer cimport PyBUF_READ
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.math cimport INFINITY, ceil, pow
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, qsort
from libc.string cimport memcpy

from fastroute._core.mix cimport mix64

cdef extern from "atomics.h" nogil:
    uint64_t fr_load_acquire_u64(const void *p)
    void fr_store_release_u64(void *p, uint64_t v)
    int64_t fr_add_fetch_i64(void *p, int64_t delta)
    void fr_fence()
from fastroute._core.selector cimport Selector, TreeState, _as_loads, _as_mask, _mask_ptr
from fastroute._core.selector_tree import WALK_CAP
from fastroute._core.shm cimport AtomicBuffer

import numpy as np
import xxhash

from fastroute._core.keylog_py import (
    ENTRY_WORDS,
    HEADER_WORDS,
    IMPORTED,
    KEY_LOG_MAGIC,
    KEY_LOG_VERSION,
    MAX_CHANNEL,
    WHOLE,
)
from fastroute._core.prefix_py import (
    DEFAULT_MAX_KEYS,
    HOT_LEAVE_RATIO,
    MAX_CANDIDATES,
    MAX_DEPTH_KEYS,
    REPEAT_HALF_LIFE_PER_ENGINE,
    depth_keys,
)

__all__ = ["HotKeys", "KeyLog", "PrefixPicker", "depth_keys"]

cdef enum:
    _KEYS_CAP = 64          # == MAX_DEPTH_KEYS (checked at import)
    _CANDIDATES_CAP = 3     # MAX_CANDIDATES + the deepest key
    _SMALL_K = 8            # rankings up to this length need no allocation
    _INITIAL_SLOTS = 256    # the share table starts here and doubles
    _WALK_CAP = 64          # == selector_tree.WALK_CAP (checked at import)

if (MAX_DEPTH_KEYS != _KEYS_CAP or MAX_CANDIDATES + 1 != _CANDIDATES_CAP
        or ENTRY_WORDS != 3 + _KEYS_CAP or WALK_CAP != _WALK_CAP):
    raise ImportError("fastroute._core.prefix was built against other prefix_py limits")

cdef object _xxh3 = xxhash.xxh3_64_intdigest
cdef double _leave_ratio = HOT_LEAVE_RATIO
cdef Py_ssize_t _max_candidates = MAX_CANDIDATES
cdef Py_ssize_t _all_keys = 1 << 30
cdef uint64_t _imported = IMPORTED
cdef uint64_t _whole_flag = WHOLE


cdef struct Slot:
    uint64_t key
    double weight       # as of stamp
    int64_t stamp       # the tick it was last observed; 0 marks an empty slot
    uint8_t hot         # hot at its last is_hot()
    uint64_t engine     # engine id of its last observation, 0 if not known


cdef int _compare_stamps(const void* a, const void* b) noexcept nogil:
    cdef int64_t x = (<const int64_t*>a)[0], y = (<const int64_t*>b)[0]
    return (x > y) - (x < y)


@cython.final
cdef class HotKeys:
    """Exponentially decayed per-key shares of the observed weight (compiled).

    Same API and same shares as ``fastroute._core.prefix_py.HotKeys``, its spec, in an
    open-addressing table (linear probing, at most 3/4 full, no deletion but by the
    rebuild of a prune).
    """

    cdef Slot* _slots
    cdef Py_ssize_t _capacity       # a power of two
    cdef Py_ssize_t _count
    cdef Py_ssize_t _max_keys
    cdef double _decay
    cdef double _total
    cdef int64_t _t

    def __cinit__(self, double half_life_requests, Py_ssize_t max_keys=DEFAULT_MAX_KEYS):
        if not half_life_requests > 0:
            raise ValueError(f"half_life_requests must be > 0, got {half_life_requests}")
        if max_keys < 16:
            raise ValueError(f"max_keys must be >= 16, got {max_keys}")
        self._decay = 0.5 ** (1.0 / half_life_requests)
        self._max_keys = max_keys
        self._slots = <Slot*>calloc(_INITIAL_SLOTS, sizeof(Slot))
        if self._slots == NULL:
            raise MemoryError()
        self._capacity = _INITIAL_SLOTS

    def __dealloc__(self):
        free(self._slots)

    @property
    def requests(self):
        """Requests observed so far (the logical clock)."""
        return self._t

    def __len__(self):
        return self._count

    cdef inline Slot* _find(self, uint64_t key) noexcept nogil:
        # The key's slot, or the empty slot where it would go.
        cdef Py_ssize_t mask = self._capacity - 1
        cdef Py_ssize_t i = <Py_ssize_t>(mix64(key) & <uint64_t>mask)
        cdef Slot* slot = &self._slots[i]
        while slot.stamp != 0 and slot.key != key:
            i = (i + 1) & mask
            slot = &self._slots[i]
        return slot

    cdef int _rehash(self, Py_ssize_t capacity, int64_t min_stamp) except -1:
        # Move every entry of stamp >= min_stamp into a fresh table of `capacity` slots.
        cdef Slot* old = self._slots
        cdef Py_ssize_t i, old_capacity = self._capacity
        cdef Slot* fresh = <Slot*>calloc(capacity, sizeof(Slot))
        if fresh == NULL:
            raise MemoryError()
        self._slots = fresh
        self._capacity = capacity
        self._count = 0
        for i in range(old_capacity):
            if old[i].stamp != 0 and old[i].stamp >= min_stamp:
                memcpy(self._find(old[i].key), &old[i], sizeof(Slot))
                self._count += 1
        free(old)
        return 0

    cdef int _observe(self, const uint64_t* keys, Py_ssize_t n_keys, double weight,
                      uint64_t engine) except -1:
        cdef int64_t t = self._t + 1
        cdef double decay = self._decay
        cdef Py_ssize_t j
        cdef Slot* slot
        self._t = t
        self._total = self._total * decay + weight
        for j in range(n_keys):
            slot = self._find(keys[j])
            if slot.stamp == 0:
                if 4 * (self._count + 1) > 3 * self._capacity:
                    self._rehash(2 * self._capacity, 1)
                    slot = self._find(keys[j])
                slot.key = keys[j]
                slot.weight = weight
                slot.hot = 0
                self._count += 1
            else:
                slot.weight = slot.weight * pow(decay, <double>(t - slot.stamp)) + weight
            slot.stamp = t
            slot.engine = engine
        if self._count > self._max_keys:
            self._prune()
        return 0

    cdef int _prune(self) except -1:
        cdef double floor = self._total / <double>self._max_keys, decay = self._decay
        cdef int64_t t = self._t, cutoff = 1
        cdef Py_ssize_t i, m = 0, keep = self._max_keys // 2
        cdef Slot* slot
        for i in range(self._capacity):
            slot = &self._slots[i]
            if slot.stamp != 0 and slot.weight * pow(decay, <double>(t - slot.stamp)) < floor:
                slot.stamp = -1  # dropped below by the rehash (stamp < 1)
        cdef int64_t* stamps = <int64_t*>malloc(self._capacity * sizeof(int64_t))
        if stamps == NULL:
            raise MemoryError()
        for i in range(self._capacity):
            if self._slots[i].stamp > 0:
                stamps[m] = self._slots[i].stamp
                m += 1
        if m > keep:
            qsort(stamps, m, sizeof(int64_t), _compare_stamps)
            cutoff = stamps[m - keep]
        free(stamps)
        return self._rehash(self._capacity, cutoff)

    cdef inline double _share(self, uint64_t key) noexcept nogil:
        cdef Slot* slot = self._find(key)
        if slot.stamp == 0 or self._total <= 0.0:
            return 0.0
        return slot.weight * pow(self._decay, <double>(self._t - slot.stamp)) / self._total

    cdef inline bint _is_hot(self, uint64_t key, double enter_share,
                             double leave_share) noexcept nogil:
        cdef Slot* slot = self._find(key)
        if slot.stamp == 0 or self._total <= 0.0:
            return False
        cdef double share = (slot.weight * pow(self._decay, <double>(self._t - slot.stamp))
                             / self._total)
        cdef bint hot = share > enter_share or (share >= leave_share and slot.hot != 0)
        slot.hot = hot
        return hot

    def observe(self, keys, double weight, uint64_t engine_id=0):
        """One request of weight ``weight`` (> 0) carried ``keys`` and was routed to
        ``engine_id`` (0: not known)."""
        cdef Py_ssize_t j, n = len(keys)
        cdef uint64_t* buf = <uint64_t*>malloc((n if n else 1) * sizeof(uint64_t))
        if buf == NULL:
            raise MemoryError()
        try:
            for j in range(n):
                buf[j] = keys[j]
            self._observe(buf, n, weight, engine_id)
        finally:
            free(buf)

    def set_half_life(self, double half_life_requests):
        """Decay by ``half_life_requests`` (> 0) from now on (see the spec)."""
        if not half_life_requests > 0:
            raise ValueError(f"half_life_requests must be > 0, got {half_life_requests}")
        self._decay = 0.5 ** (1.0 / half_life_requests)

    def share(self, uint64_t key):
        """The key's decayed share of the observed weight, in [0, 1]; 0 if unseen."""
        return self._share(key)

    def engine(self, uint64_t key):
        """The engine the last request that carried ``key`` was routed to; 0 if unseen or
        not known."""
        cdef Slot* slot = self._find(key)
        return slot.engine if slot.stamp != 0 else 0

    def is_hot(self, uint64_t key, double enter_share, double leave_share):
        """Whether ``key``'s group is hot, with hysteresis (see the spec)."""
        return self._is_hot(key, enter_share, leave_share)

    def reset(self):
        """Forget every observation."""
        self._t = 0
        self._total = 0.0
        self._rehash(_INITIAL_SLOTS, 1 << 62)


cdef enum:
    _HEADER_WORDS = 8       # == keylog_py.HEADER_WORDS (checked at import)
    _HEAD_WORD = 4          # head: entries reserved so far
    _ENTRY_WORDS = 3 + _KEYS_CAP    # seq, meta, engine, keys (== keylog_py.ENTRY_WORDS)

if HEADER_WORDS != _HEADER_WORDS:
    raise ImportError("fastroute._core.prefix was built against another key log layout")

cdef uint64_t _key_log_magic = KEY_LOG_MAGIC
cdef uint64_t _key_log_version = KEY_LOG_VERSION
cdef uint64_t _mask32 = 0xFFFFFFFF


@cython.final
cdef class KeyLog:
    """One reader and writer of the host's key log (compiled); same API, layout and
    observations as ``fastroute._core.keylog_py.KeyLog``, its spec. ``lock_fd`` is
    ignored: ``head++`` is a CPU atomic here."""

    cdef AtomicBuffer _buffer      # holds the buffer; _words is its base
    cdef uint64_t* _words
    cdef readonly int64_t capacity
    cdef readonly uint32_t writer_id
    cdef readonly uint8_t channel
    cdef readonly int64_t lost
    cdef readonly int64_t observed
    cdef int64_t _next

    def __cinit__(self, buffer, int64_t writer_id, int channel, lock_fd=None):
        if not 0 <= writer_id <= <int64_t>_mask32 or not 0 <= channel <= MAX_CHANNEL:
            raise ValueError(f"writer_id must fit 32 bits and channel 0-{MAX_CHANNEL}, "
                             f"got {writer_id}, {channel}")
        self._buffer = AtomicBuffer(buffer, writable=True)
        self._words = <uint64_t*>self._buffer._base
        cdef Py_ssize_t size = self._buffer.size
        cdef uint64_t capacity = 0
        if size >= 8 * _HEADER_WORDS and (<size_t>self._words) % 8 == 0:
            capacity = fr_load_acquire_u64(&self._words[2])
        if (capacity < 16 or capacity & (capacity - 1) or capacity > (<uint64_t>1 << 40)
                or fr_load_acquire_u64(&self._words[0]) != _key_log_magic
                or fr_load_acquire_u64(&self._words[1]) != _key_log_version
                or fr_load_acquire_u64(&self._words[3]) != <uint64_t>ENTRY_WORDS
                or <uint64_t>size < 8 * (_HEADER_WORDS + capacity * _ENTRY_WORDS)):
            self.release()
            raise ValueError("the buffer does not hold a fastroute key log of this version")
        self.capacity = <int64_t>capacity
        self.writer_id = <uint32_t>writer_id
        self.channel = <uint8_t>channel
        cdef int64_t head = <int64_t>fr_load_acquire_u64(&self._words[_HEAD_WORD])
        self._next = head - self.capacity if head > self.capacity else 0

    def release(self):
        """Release the buffer (so that its mmap can be closed)."""
        self._buffer.release()
        self._words = NULL

    @property
    def position(self):
        """The next entry this reader reads."""
        return self._next

    cdef inline uint64_t* _entry(self, int64_t position) noexcept nogil:
        return self._words + _HEADER_WORDS + (position & (self.capacity - 1)) * _ENTRY_WORDS

    cdef int _publish(self, const uint64_t* keys, Py_ssize_t n_keys,
                      Py_ssize_t n_observe, uint64_t engine, bint has_whole=False,
                      uint64_t whole=0) except -1:
        # With a whole prompt key (room left): appended last, the entry marked WHOLE.
        cdef uint64_t buf[_KEYS_CAP]
        if not has_whole or n_keys >= _KEYS_CAP:
            return self._append(keys, n_keys, n_observe, self.channel, 0, engine)
        memcpy(buf, keys, n_keys * sizeof(uint64_t))
        buf[n_keys] = whole
        return self._append(buf, n_keys + 1, min(n_observe, n_keys), self.channel,
                            _whole_flag, engine)

    cdef int _append(self, const uint64_t* keys, Py_ssize_t n_keys, Py_ssize_t n_observe,
                     uint64_t channel, uint64_t flags, uint64_t engine) except -1:
        if self._words == NULL:
            raise ValueError("KeyLog has been released")
        if n_keys > _KEYS_CAP:
            n_keys = _KEYS_CAP
        n_observe = max(0, min(n_observe, n_keys))
        cdef int64_t position = fr_add_fetch_i64(&self._words[_HEAD_WORD], 1) - 1
        cdef uint64_t* entry = self._entry(position)
        cdef Py_ssize_t j
        fr_store_release_u64(&entry[0], 0)
        fr_fence()
        fr_store_release_u64(&entry[1], <uint64_t>self.writer_id | (channel << 32)
                             | (<uint64_t>n_keys << 40) | (<uint64_t>n_observe << 48) | flags)
        fr_store_release_u64(&entry[2], engine)
        for j in range(n_keys):
            fr_store_release_u64(&entry[3 + j], keys[j])
        fr_store_release_u64(&entry[0], <uint64_t>(position + 1))
        return 0

    cdef bint _read(self, int64_t position, uint64_t* meta, uint64_t* engine, uint64_t* keys,
                    Py_ssize_t* n_keys) noexcept nogil:
        # The entry at position into meta/engine/keys; false (counted lost) if it is being
        # written or was overwritten.
        cdef uint64_t* entry = self._entry(position)
        cdef uint64_t seq = fr_load_acquire_u64(&entry[0])
        cdef Py_ssize_t j
        meta[0] = fr_load_acquire_u64(&entry[1])
        engine[0] = fr_load_acquire_u64(&entry[2])
        n_keys[0] = min(<Py_ssize_t>((meta[0] >> 40) & 0xFF), <Py_ssize_t>_KEYS_CAP)
        for j in range(n_keys[0]):
            keys[j] = fr_load_acquire_u64(&entry[3 + j])
        fr_fence()
        if seq != <uint64_t>(position + 1) or fr_load_acquire_u64(&entry[0]) != seq:
            self.lost += 1
            return False
        return True

    cdef Py_ssize_t _drain(self, HotKeys hot, HotKeys seen, HotKeys wholes) except -1:
        if self._words == NULL:
            raise ValueError("KeyLog has been released")
        cdef int64_t head = <int64_t>fr_load_acquire_u64(&self._words[_HEAD_WORD])
        cdef int64_t position = self._next
        cdef Py_ssize_t observed = 0, n_keys
        cdef uint64_t meta, engine
        cdef uint64_t keys[_KEYS_CAP]
        if head - position > self.capacity:
            self.lost += head - self.capacity - position
            position = head - self.capacity
        while position < head:
            if (self._read(position, &meta, &engine, keys, &n_keys)
                    and (meta & _mask32) != self.writer_id
                    and ((meta >> 32) & 0xFF) == self.channel):
                if meta & _whole_flag and n_keys > 0:
                    n_keys -= 1  # the whole prompt key, for wholes alone
                    if wholes is not None:
                        wholes._observe(&keys[n_keys], 1, 1.0, 0)
                elif wholes is not None:
                    wholes._observe(keys, 0, 1.0, 0)  # every request counts
                hot._observe(keys, min(<Py_ssize_t>((meta >> 48) & 0xFF), n_keys), 1.0, 0)
                seen._observe(keys, n_keys, 1.0, engine)
                observed += 1
            position += 1
        self._next = position
        self.observed += observed
        return observed

    def publish(self, keys, Py_ssize_t n_observe, uint64_t engine_id=0, whole=None):
        """Append one routed request's ``keys``, engine and whole prompt key (see the
        spec)."""
        cdef uint64_t buf[_KEYS_CAP]
        cdef Py_ssize_t j, n = min(len(keys), <Py_ssize_t>_KEYS_CAP)
        for j in range(n):
            buf[j] = keys[j]
        self._publish(buf, n, n_observe, engine_id, whole is not None,
                      0 if whole is None else <uint64_t>whole)

    def publish_imported(self, keys, Py_ssize_t n_observe, int channel, uint64_t engine_id=0):
        """Append an entry another proxy's log exported, marked imported (see the spec)."""
        if not 0 <= channel <= MAX_CHANNEL:
            raise ValueError(f"channel must be 0-{MAX_CHANNEL}, got {channel}")
        cdef uint64_t buf[_KEYS_CAP]
        cdef Py_ssize_t j, n = min(len(keys), <Py_ssize_t>_KEYS_CAP)
        for j in range(n):
            buf[j] = keys[j]
        self._append(buf, n, n_observe, <uint64_t>channel, _imported, engine_id)

    def drain(self, HotKeys hot, HotKeys seen, HotKeys wholes=None):
        """Observe the other writers' new entries of this channel (see the spec)."""
        return self._drain(hot, seen, wholes)

    def export(self, int64_t since, int64_t max_entries):
        """The host's own entries from ``since``: (next position, [(channel, n_observe,
        keys, engine_id)]) (see the spec)."""
        if self._words == NULL:
            raise ValueError("KeyLog has been released")
        cdef int64_t head = <int64_t>fr_load_acquire_u64(&self._words[_HEAD_WORD])
        cdef int64_t oldest = head - self.capacity if head > self.capacity else 0
        cdef int64_t position = since if oldest <= since <= head else oldest
        cdef int64_t stop = min(head, position + max(<int64_t>0, max_entries))
        cdef uint64_t meta, engine
        cdef uint64_t keys[_KEYS_CAP]
        cdef Py_ssize_t n_keys, j
        entries = []
        while position < stop:
            if self._read(position, &meta, &engine, keys, &n_keys) and not meta & _imported:
                if meta & _whole_flag and n_keys > 0:
                    n_keys -= 1  # the whole prompt keys stay on their host
                entries.append((<int>((meta >> 32) & 0xFF), <int>((meta >> 48) & 0xFF),
                                [keys[j] for j in range(n_keys)], engine))
            position += 1
        return stop, entries


cdef const double[:] _as_costs(object prefill_cost, Py_ssize_t n):
    # Each engine's relative prefill time per token as float64 (a copy only if needed).
    cdef const double[:] cost = np.ascontiguousarray(prefill_cost, dtype=np.float64)
    if cost.shape[0] != n:
        raise ValueError(f"prefill_cost must have shape ({n},), got ({cost.shape[0]},)")
    return cost


cdef inline uint64_t _whole_key(const RequestKeys* keys, Py_ssize_t n_keys,
                                Py_ssize_t block_bytes, int64_t key_depth, const char* data,
                                Py_ssize_t length, uint64_t prompt_tokens) except? 0:
    # The spec's PrefixPicker._whole_key: xxh3_64 of the bytes read, mixed with the prompt's
    # tokens, reusing the deepest depth key's hash (among keys[:n_keys], the routing key
    # left out) when that depth is all of the bytes read.
    cdef Py_ssize_t j = n_keys - 1
    while j >= 0 and (keys.depths[j] < block_bytes or keys.depths[j] == key_depth):
        j -= 1
    if j >= 0 and keys.depths[j] == length:
        return keys.hashes[j] ^ mix64(prompt_tokens)
    return (<uint64_t>_xxh3(PyMemoryView_FromMemory(<char*>data, length, PyBUF_READ))
            ^ mix64(prompt_tokens))


cdef inline Py_ssize_t _move_to_front(Py_ssize_t* ranked, Py_ssize_t m, Py_ssize_t k,
                                      Py_ssize_t first) noexcept nogil:
    # ranked[:m] becomes [first, *ranked[:m] without first][:k]; returns its length.
    cdef Py_ssize_t i = 0, j
    while i < m and ranked[i] != first:
        i += 1
    if i == m:
        if m == k:
            m -= 1
        i = m
        m += 1
    for j in range(i, 0, -1):
        ranked[j] = ranked[j - 1]
    ranked[0] = first
    return m


cdef struct RequestKeys:
    # One request's keys, shallow first, and how many of them on_routed observes.
    int64_t depths[_KEYS_CAP]
    uint64_t hashes[_KEYS_CAP]
    Py_ssize_t n_keys
    Py_ssize_t n_observe
    Py_ssize_t route_at             # index of the routing key, -1 if not among them
    uint64_t whole                  # the whole prompt key, when has_whole
    bint has_whole                  # whether on_routed counts it (a decided request's)


cdef struct Candidates:
    # The keys rules 1-2 try, in order (the spec's candidates), and a repeat's turn.
    uint64_t keys[_CANDIDATES_CAP]
    int64_t depths[_CANDIDATES_CAP]
    Py_ssize_t n
    Py_ssize_t turn                 # -2: not a repeat; -1: a salted home; else the turn


@cython.final
cdef class PrefixPicker:
    """The per-request work of ``prefix-hrw`` (compiled); same API and decisions as
    ``fastroute._core.prefix_py.PrefixPicker``, its spec. ``choose`` takes the compiled
    ``Selector``."""

    cdef readonly Py_ssize_t block_bytes
    cdef readonly Py_ssize_t prefix_bytes
    cdef readonly double balance_factor
    cdef readonly double affinity_slack
    cdef readonly double stall_weight
    cdef readonly double hot_share_factor
    cdef readonly bint deep
    cdef readonly double bytes_per_token
    cdef readonly HotKeys hot
    cdef readonly HotKeys seen      # every depth of every routed request (the saving)
    cdef readonly HotKeys wholes    # whole prompts' shares (repeats spread)
    cdef Py_ssize_t _wholes_engines # the most eligible engines a decision saw
    cdef RequestKeys _last          # keys of the last decided request
    cdef uint64_t _repeats          # decisions that spread a hot repeated prompt (turns)
    cdef object _last_request       # held, so that its identity cannot be reused
    cdef readonly KeyLog log        # the host's other workers' keys, or None

    def __init__(self, Py_ssize_t block_bytes, Py_ssize_t prefix_bytes, double balance_factor,
                 double hot_share_factor, double hot_half_life_requests, bint deep=False,
                 double bytes_per_token=4.0, Py_ssize_t max_keys=DEFAULT_MAX_KEYS,
                 double affinity_slack=1.0, double stall_weight=0.0):
        if block_bytes < 1 or prefix_bytes // block_bytes >= (<Py_ssize_t>1) << (_KEYS_CAP - 2):
            raise ValueError(f"at most {_KEYS_CAP - 1} depths: prefix_bytes / block_bytes "
                             f"must be < 2**{_KEYS_CAP - 2}")
        self.block_bytes = block_bytes
        self.prefix_bytes = prefix_bytes
        self.balance_factor = balance_factor
        self.affinity_slack = affinity_slack
        self.stall_weight = stall_weight
        self.hot_share_factor = hot_share_factor
        self.deep = deep
        self.bytes_per_token = bytes_per_token
        self.hot = HotKeys(hot_half_life_requests, max_keys)
        self.seen = HotKeys(hot_half_life_requests, max_keys)
        self.wholes = HotKeys(REPEAT_HALF_LIFE_PER_ENGINE, max_keys)
        self._wholes_engines = 1
        self._last_request = None
        self._repeats = 0
        self.log = None

    def attach_log(self, KeyLog log):
        """Share observations through ``log`` (None: this worker's own only; see the
        spec); replays its recent entries now."""
        self.log = log
        if log is not None:
            log._drain(self.hot, self.seen, self.wholes)

    cdef int _fill_keys(self, object prefix, uint64_t key_hash, int64_t key_depth,
                        uint64_t prompt_tokens, RequestKeys* out) except -1:
        if not isinstance(prefix, bytes):
            prefix = bytes(prefix)
        cdef char* data = PyBytes_AS_STRING(prefix)
        cdef Py_ssize_t length = min(PyBytes_GET_SIZE(prefix), self.prefix_bytes)
        cdef Py_ssize_t n = 0, at, j
        cdef Py_ssize_t depth = self.block_bytes
        while depth <= length:
            out.depths[n] = depth
            out.hashes[n] = _xxh3(PyMemoryView_FromMemory(data, depth, PyBUF_READ))
            n += 1
            depth *= 2
        out.route_at = -1
        out.has_whole = False
        if n == 0:
            out.depths[0] = 0
            out.hashes[0] = key_hash
            n = 1
            if key_depth == 0:
                out.route_at = 0
        elif key_depth >= 0:
            at = 0
            while at < n and out.depths[at] <= key_depth:
                at += 1
            for j in range(n, at, -1):
                out.depths[j] = out.depths[j - 1]
                out.hashes[j] = out.hashes[j - 1]
            out.depths[at] = key_depth
            out.hashes[at] = key_hash
            out.route_at = at
            n += 1
        else:
            # no conversation key: the whole prompt is the deepest group (the spec)
            out.depths[n] = length
            out.hashes[n] = _whole_key(out, n, self.block_bytes, key_depth, data, length,
                                       prompt_tokens)
            n += 1
        out.n_keys = n
        out.n_observe = _all_keys
        return 0

    def keys(self, prefix, uint64_t key_hash, int64_t key_depth_bytes,
             uint64_t prompt_tokens=0):
        """The request's ``(depth_bytes, key)`` pairs, shallow first (see the spec)."""
        cdef RequestKeys keys
        self._fill_keys(prefix, key_hash, key_depth_bytes, prompt_tokens, &keys)
        return [(keys.depths[j], keys.hashes[j]) for j in range(keys.n_keys)]

    cdef inline bint _cold(self, Py_ssize_t n_eligible) noexcept nogil:
        # The spec's _cold: too few observations to tell a share from noise.
        return n_eligible > 1 and self.hot._t < 2 * n_eligible

    cdef Py_ssize_t _candidates(self, RequestKeys* keys, Py_ssize_t n_eligible,
                                Py_ssize_t* chosen, bint* every_hot) noexcept nogil:
        # The spec's _candidates: indices into keys of the keys to try, their count
        # returned, keys.n_observe and every_hot (no key of the request is cold) set.
        cdef Py_ssize_t n = keys.n_keys, j, i, c, n_chosen = 0, last = 0
        cdef Py_ssize_t step = -1 if self.deep else 1, first = n - 1 if self.deep else 0
        cdef double enter, leave
        every_hot[0] = False
        if self._cold(n_eligible):
            # too few observations: the routing key, else the most specific key
            chosen[0] = keys.route_at if keys.route_at >= 0 else n - 1
            keys.n_observe = n if self.deep else 1 + min(n, _max_candidates)
            if chosen[0] == n - 1:
                return 1
            chosen[1] = n - 1
            return 2
        if n_eligible > 1:
            enter = self.hot_share_factor / <double>n_eligible
            leave = enter * _leave_ratio
            for j in range(n):
                i = first + step * j
                if not self.hot._is_hot(keys.hashes[i], enter, leave):
                    chosen[n_chosen] = i
                    n_chosen += 1
                    if n_chosen == _max_candidates:
                        break
            if n_chosen == 0:
                every_hot[0] = True
                chosen[0] = first + step * (n - 1)
                n_chosen = 1
        else:
            for j in range(min(n, _max_candidates)):
                chosen[j] = first + step * j
            n_chosen = min(n, _max_candidates)
        # The last key equal (depth and hash) to a chosen one: the spec compares pairs.
        for i in range(n):
            for c in range(n_chosen):
                if (keys.depths[i] == keys.depths[chosen[c]]
                        and keys.hashes[i] == keys.hashes[chosen[c]]):
                    last = i
        keys.n_observe = n if self.deep else 2 + last
        i = chosen[n_chosen - 1]
        if keys.depths[i] != keys.depths[n - 1] or keys.hashes[i] != keys.hashes[n - 1]:
            chosen[n_chosen] = n - 1
            n_chosen += 1
        return n_chosen

    def choose(self, Selector selector, request, available, loads, Py_ssize_t k,
               in_flight=None, prefill_cost=None):
        """Decide ``request`` over ``available`` and ``loads`` (``in_flight``: a callable
        returning the requests in flight per engine, read only when the request would leave
        its home; ``prefill_cost``: each engine's time per prefilled token relative to the
        fastest's, or None): ``(ranked, reason, depth, cached_tokens)`` as the spec."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        cdef Py_ssize_t row = request.row
        selector._check_row(row)
        if self.log is not None:
            self.log._drain(self.hot, self.seen, self.wholes)
        cdef RequestKeys* keys = &self._last
        self._last_request = None  # until the keys below are complete
        self._fill_keys(request.prefix, request.key_hash, request.key_depth_bytes,
                        request.prompt_tokens, keys)
        cdef Py_ssize_t n = selector.n_engines, i
        cdef const uint8_t[::1] mask = _as_mask(available, n)
        cdef const uint8_t* mask_ptr = _mask_ptr(mask)
        cdef const int64_t[:] load = _as_loads(loads, n)
        cdef const double[:] cost = None
        if prefill_cost is not None:
            cost = _as_costs(prefill_cost, n)
        cdef TreeState tree = selector._tree_for(row, available, mask_ptr)
        cdef Candidates c
        self._rule_one(request, keys, tree.m, &c)
        self._last_request = request
        if k > tree.m:
            k = tree.m
        if k == 0:
            return [], "", -1, 0
        cdef Py_ssize_t small_idx[_SMALL_K]
        cdef Py_ssize_t* out_idx = small_idx
        if k > _SMALL_K:
            out_idx = <Py_ssize_t*>malloc(k * sizeof(Py_ssize_t))
            if out_idx == NULL:
                raise MemoryError()
        cdef Py_ssize_t m, used, least, placed
        cdef int64_t placed_depth = 0
        cdef bint cold = self._cold(tree.m), bounded
        # The first candidate's home may exceed the bound by what staying there saves.
        cdef double home_saving = self._saving_tokens(keys, 0 if cold else c.depths[0])
        cdef double saving
        try:
            m = self._bounded_rank(selector, tree, &c, row, k, load, home_saving, in_flight,
                                   out_idx, &used)
            if m == 0:
                return [], "", -1, 0
            if c.turn >= 0:
                m = self._replica(selector, tree, keys.whole, c.turn, out_idx, m, k, row, load)
            bounded = used >= c.n
            if bounded:
                reason, depth, saving = "bounded-spill", -1, 0.0
            else:
                depth = c.depths[used]
                reason = "prefix-home" if used == 0 else "prefix-spill"
                if c.turn > -2:
                    reason = "repeat-spread"
                elif len(request.prefix) < self.block_bytes:
                    reason = "no-prefix"
                # cold: the deciding key was not chosen for its cache, so only what was
                # observed
                saving = (home_saving if used == 0
                          else self._saving_tokens(keys, 0 if cold else depth))
                if depth == 0 and request.key_depth_bytes == 0:
                    # the client's session: never cost-spilled
                    return [out_idx[i] for i in range(m)], reason, depth, <int64_t>saving
            placed = self._last_placement(selector, tree, keys, c.depths[0],
                                          out_idx[0], row, load, mask_ptr, &placed_depth)
            if placed >= 0:
                # the spec's follow: the request's deepest seen prefix was last sent there
                m = _move_to_front(out_idx, m, k, placed)
                reason, depth = "prefix-follow", placed_depth
                saving = <double>placed_depth / self.bytes_per_token
            elif bounded:
                return [out_idx[i] for i in range(m)], reason, depth, 0
            if cost is None:
                least = self._cheaper_elsewhere(selector, tree, keys, saving, out_idx[0], row,
                                                load, in_flight)
            else:
                least = self._cheaper_in_time(keys.hashes[keys.n_keys - 1], saving, out_idx[0],
                                              load, mask_ptr, in_flight, cost)
            if least < 0:
                return [out_idx[i] for i in range(m)], reason, depth, <int64_t>saving
            m = _move_to_front(out_idx, m, k, least)
            return [out_idx[i] for i in range(m)], "cost-spill", -1, 0
        finally:
            if k > _SMALL_K:
                free(out_idx)

    cdef int _rule_one(self, object request, RequestKeys* keys, Py_ssize_t n_eligible,
                       Candidates* c) except -1:
        # Rule 1 (the spec's _candidates, then _repeat): the keys to try, into c.
        cdef Py_ssize_t chosen[_CANDIDATES_CAP]
        cdef Py_ssize_t i, length
        cdef bint every_hot
        c.n = self._candidates(keys, n_eligible, chosen, &every_hot)
        c.turn = -2
        for i in range(c.n):
            c.keys[i] = keys.hashes[chosen[i]]
            c.depths[i] = keys.depths[chosen[i]]
        if request.key_depth_bytes == 0:  # a declared session keeps its home
            return 0
        length = self._request_whole_key(request, keys, every_hot)
        if every_hot:
            keys.n_observe = keys.n_keys
        c.turn = self._repeat(keys.whole, length, n_eligible, c.keys, c.depths)
        if c.turn > -2:
            c.n = 1
            keys.n_observe = keys.n_keys
        return 0

    cdef Py_ssize_t _bounded_rank(self, Selector selector, TreeState tree, const Candidates* c,
                                  Py_ssize_t row, Py_ssize_t k, const int64_t[:] load,
                                  double home_saving, object in_flight, Py_ssize_t* out_idx,
                                  Py_ssize_t* used) except -1:
        # The spec's _bounded_rank: rule 2's ranking into out_idx (its length returned),
        # the first home's slack a * saving, plus the stall at t when still elsewhere.
        cdef int64_t slack = <int64_t>(self.affinity_slack * home_saving), stall
        cdef Py_ssize_t m = selector._tree_rank_prefix_c(tree, c.keys, c.n, row, k, load,
                                                         self.balance_factor, out_idx, used,
                                                         slack)
        if m == 0 or used[0] == 0 or in_flight is None or self.stall_weight <= 0.0:
            return m
        stall = <int64_t>(self.stall_weight * home_saving * <double>in_flight()[out_idx[0]])
        if stall <= 0:
            return m
        return selector._tree_rank_prefix_c(tree, c.keys, c.n, row, k, load,
                                            self.balance_factor, out_idx, used, slack + stall)

    cdef Py_ssize_t _request_whole_key(self, object request, RequestKeys* keys,
                                       bint every_hot) except -1:
        # The spec's _request_whole_key: keys.whole set (a completion's last key, else
        # computed, and appended when every key is hot); returns the bytes read.
        prefix = request.prefix
        if not isinstance(prefix, bytes):
            prefix = bytes(prefix)
        cdef Py_ssize_t length = min(PyBytes_GET_SIZE(prefix), self.prefix_bytes)
        cdef int64_t key_depth = request.key_depth_bytes
        keys.has_whole = True
        if key_depth < 0 and length >= self.block_bytes:
            keys.whole = keys.hashes[keys.n_keys - 1]  # already their last (_fill_keys)
            return length
        keys.whole = _whole_key(keys, keys.n_keys, self.block_bytes, key_depth,
                                PyBytes_AS_STRING(prefix), length, request.prompt_tokens)
        if every_hot:
            keys.depths[keys.n_keys] = length
            keys.hashes[keys.n_keys] = keys.whole
            keys.n_keys += 1
        return length

    cdef Py_ssize_t _repeat(self, uint64_t whole, Py_ssize_t length, Py_ssize_t n_eligible,
                            uint64_t* candidate_keys, int64_t* candidate_depths) except -3:
        # The spec's _repeat: -2 when the whole prompt is not hot in wholes; else the first
        # candidate becomes the whole key and its turn among the replicas is returned, or,
        # past WALK_CAP replicas, the key salted with the turn and -1.
        if n_eligible < 2 or self._cold(n_eligible):
            return -2
        if n_eligible > self._wholes_engines:
            self._wholes_engines = n_eligible
            self.wholes.set_half_life(REPEAT_HALF_LIFE_PER_ENGINE * n_eligible)
        cdef double enter = self.hot_share_factor / <double>n_eligible
        if not self.wholes._is_hot(whole, enter, enter * _leave_ratio):
            return -2
        self._repeats += 1
        cdef Py_ssize_t replicas = max(1, min(n_eligible,
                                              <Py_ssize_t>ceil(self.wholes._share(whole) / enter)))
        cdef Py_ssize_t turn = <Py_ssize_t>(self._repeats % <uint64_t>replicas)
        candidate_depths[0] = length
        if replicas > _WALK_CAP:
            candidate_keys[0] = whole ^ mix64(1 + turn)
            return -1
        candidate_keys[0] = whole
        return turn

    cdef Py_ssize_t _replica(self, Selector selector, TreeState tree, uint64_t whole,
                             Py_ssize_t turn, Py_ssize_t* ranked, Py_ssize_t m, Py_ssize_t k,
                             Py_ssize_t row, const int64_t[:] load) except -1:
        # The spec's _replica: ranked[:m] led by position turn of the whole key's ranking
        # when that engine is within bound; returns the new length.
        cdef Py_ssize_t walked[_WALK_CAP]
        cdef Py_ssize_t n = selector._tree_rank_c(tree, whole, row, turn + 1, walked, load,
                                                  0.0, 0.0, 0, -1, False)
        if n <= turn:
            return m
        cdef Py_ssize_t target = walked[turn]
        if target == ranked[0] or not selector._tree_within_bound(tree, target, row, load,
                                                                   self.balance_factor, 0):
            return m
        return _move_to_front(ranked, m, k, target)

    cdef Py_ssize_t _last_placement(self, Selector selector, TreeState tree,
                                    const RequestKeys* keys, int64_t group_depth,
                                    Py_ssize_t decided, Py_ssize_t row, const int64_t[:] load,
                                    const uint8_t* mask, int64_t* depth):
        # The spec's _last_placement: the engine index (-1 if none) and, in depth, the
        # depth of the deepest seen key below the group's, when its last placement is
        # known, eligible, not decided and within bound less its saving.
        cdef Py_ssize_t at = self._deepest_seen(keys, group_depth), placed = -1
        if at < 0:
            return -1
        cdef uint64_t engine = self.seen._find(keys.hashes[at]).engine
        if engine != 0:
            placed = selector._eligible_index(engine, row, mask)
        cdef int64_t slack = <int64_t>(self.affinity_slack
                                       * (<double>keys.depths[at] / self.bytes_per_token))
        if (placed < 0 or placed == decided
                or not selector._tree_within_bound(tree, placed, row, load,
                                                   self.balance_factor, slack)):
            return -1
        depth[0] = keys.depths[at]
        return placed

    cdef Py_ssize_t _deepest_seen(self, const RequestKeys* keys,
                                  int64_t above_depth) noexcept nogil:
        # The spec's _deepest_seen: the index of the deepest key deeper than above_depth
        # that the seen table holds, else -1.
        cdef Py_ssize_t j
        for j in range(keys.n_keys - 1, -1, -1):
            if keys.depths[j] <= above_depth:
                return -1
            if self.seen._share(keys.hashes[j]) > 0.0:
                return j
        return -1

    cdef double _saving_tokens(self, const RequestKeys* keys, int64_t depth):
        # The spec's _saving_tokens: the deepest depth the seen table holds, >= depth.
        cdef Py_ssize_t at = self._deepest_seen(keys, depth)
        return <double>(depth if at < 0 else keys.depths[at]) / self.bytes_per_token

    cdef Py_ssize_t _cheaper_elsewhere(self, Selector selector, TreeState tree,
                                       const RequestKeys* keys, double saving_tokens,
                                       Py_ssize_t home, Py_ssize_t row,
                                       const int64_t[:] load, object in_flight):
        # The spec's _cheaper_elsewhere, on the tree's load chunks.
        cdef int64_t home_load = load[home]
        cdef Py_ssize_t least
        if <double>home_load <= saving_tokens:
            return -1
        least = selector._tree_least_loaded(tree, keys.hashes[keys.n_keys - 1], row, load)
        if least < 0 or least == home:
            return -1
        return self._spill_pays(least, <double>(home_load - load[least]), load[least], 1.0,
                                saving_tokens, in_flight)

    cdef Py_ssize_t _cheaper_in_time(self, uint64_t key, double saving_tokens, Py_ssize_t home,
                                     const int64_t[:] load, const uint8_t* mask,
                                     object in_flight, const double[:] cost):
        # The spec's _cheaper_in_time: the cost spill in prefill time, one pass over the
        # eligible engines for t (the least (L_e + saving) * r_e, ties by mix64(key ^ e)).
        cdef double home_s = <double>load[home] * cost[home], least_s = INFINITY, start_s
        cdef double rate
        cdef uint64_t tie, least_tie = 0
        cdef Py_ssize_t e, least = -1
        if home_s <= saving_tokens:
            return -1  # no engine can start sooner by more than the saving
        for e in range(load.shape[0]):
            if mask[e] == 0 or e == home:
                continue
            start_s = (<double>load[e] + saving_tokens) * cost[e]
            tie = mix64(key ^ <uint64_t>e)
            if start_s < least_s or (start_s == least_s and tie < least_tie):
                least, least_s, least_tie = e, start_s, tie
        if least < 0:
            return -1
        rate = cost[least]
        return self._spill_pays(least, home_s - <double>load[least] * rate, load[least], rate,
                                saving_tokens, in_flight)

    cdef Py_ssize_t _spill_pays(self, Py_ssize_t target, double gain, int64_t target_load,
                                double rate, double saving_tokens, object in_flight):
        # The spec's _spill_pays: target if the gain pays for the re-prefilled saving and the
        # queue it joins, then for the decodes it stalls there (each times rate), else -1.
        cdef int64_t stalled
        if gain <= (saving_tokens + <double>target_load) * rate:
            return -1  # the gain does not pay for the queue the request joins (the spec)
        if in_flight is None or self.stall_weight <= 0.0 or saving_tokens <= 0.0:
            return target
        stalled = in_flight()[target]
        if gain <= (saving_tokens + <double>target_load
                    + self.stall_weight * saving_tokens * <double>stalled) * rate:
            return -1  # nor for the decodes its re-prefill stalls there (the spec)
        return target

    def on_routed(self, request, uint64_t engine_id=0):
        """``request`` was sent to ``engine_id`` (0: not known): count it, one request,
        for its keys' shares, and record its keys' last placement (see the spec)."""
        cdef RequestKeys fresh
        cdef RequestKeys* keys = &self._last
        if request is not self._last_request:
            self._fill_keys(request.prefix, request.key_hash, request.key_depth_bytes,
                            request.prompt_tokens, &fresh)
            keys = &fresh
        cdef Py_ssize_t n_observe = min(keys.n_keys, keys.n_observe)
        self.hot._observe(keys.hashes, n_observe, 1.0, 0)
        self.seen._observe(keys.hashes, keys.n_keys, 1.0, engine_id)
        # every request counts in wholes, with its whole key when it has one
        self.wholes._observe(&keys.whole, 1 if keys.has_whole else 0, 1.0, 0)
        if self.log is not None:
            self.log._publish(keys.hashes, keys.n_keys, n_observe, engine_id, keys.has_whole,
                              keys.whole)

    def reset(self):
        """Forget every observation."""
        self.hot.reset()
        self.seen.reset()
        self.wholes.reset()
        self.wholes.set_half_life(REPEAT_HALF_LIFE_PER_ENGINE)
        self._wholes_engines = 1
        self._last_request = None
        self._repeats = 0
