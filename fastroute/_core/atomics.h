/* C11-style atomics on raw shared memory (GCC/Clang builtins), for shm.pyx.
 * Shared memory written by several processes: every access to a shared word goes
 * through one of these, so the compiler neither tears nor reorders it. */
#ifndef FASTROUTE_ATOMICS_H
#define FASTROUTE_ATOMICS_H
#include <stdint.h>
#include <string.h>

static inline uint64_t fr_load_acquire_u64(const void *p) {
    return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE);
}
static inline void fr_store_release_u64(void *p, uint64_t v) {
    __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE);
}
static inline double fr_load_acquire_f64(const void *p) {
    uint64_t bits = __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE);
    double value;
    memcpy(&value, &bits, sizeof value);
    return value;
}
static inline void fr_store_release_f64(void *p, double value) {
    uint64_t bits;
    memcpy(&bits, &value, sizeof bits);
    __atomic_store_n((uint64_t *)p, bits, __ATOMIC_RELEASE);
}
static inline int64_t fr_add_fetch_i64(void *p, int64_t delta) {
    return __atomic_add_fetch((int64_t *)p, delta, __ATOMIC_SEQ_CST);
}
static inline void fr_fence(void) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
/* EWMA on a double slot by compare-and-swap of its bit pattern; NaN = "no sample yet". */
static inline double fr_ewma_f64(void *p, double sample, double alpha) {
    uint64_t *word = (uint64_t *)p;
    uint64_t old_bits = __atomic_load_n(word, __ATOMIC_RELAXED), new_bits;
    double old_value, new_value;
    do {
        memcpy(&old_value, &old_bits, sizeof old_value);
        new_value = (old_value != old_value) ? sample : old_value + alpha * (sample - old_value);
        memcpy(&new_bits, &new_value, sizeof new_bits);
    } while (!__atomic_compare_exchange_n(word, &old_bits, new_bits, 1,
                                          __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
    return new_value;
}
#endif
