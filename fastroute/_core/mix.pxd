# Inline integer mixing helpers of the compiled core (sklearn `_random.pxd` habit).
# Their spec is the pure-Python twin in selector_py.py; any divergence is a bug.
from libc.stdint cimport int64_t, uint64_t


cdef inline uint64_t mix64(uint64_t z) noexcept nogil:
    # splitmix64 finaliser (Stafford "Mix13"): a bijection with full avalanche.
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline uint64_t engine_seed(uint64_t engine_id) noexcept nogil:
    # Salted so that small integer ids (0, 1, 2, ...) still get unrelated seeds.
    return mix64(engine_id ^ <uint64_t>0x9E3779B97F4A7C15ULL)


cdef inline double unit_open(uint64_t h) noexcept nogil:
    # Top 52 hash bits to a double strictly inside (0, 1): ((h >> 12) + 0.5) * 2**-52,
    # exact (53 bits would round (2**53 - 1) + 0.5 up to 2**53, i.e. u == 1).
    # (h >> 12) fits int64: a signed conversion is one instruction on x86-64, the
    # unsigned one a branchy sequence; the value is the same.
    return (<double><int64_t>(h >> 12) + 0.5) * 2.220446049250313e-16
