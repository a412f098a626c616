"""A small log-bucket histogram for in-band latencies (fixed memory, O(1) observe).

Bucket ``i`` (``1 <= i < N_BUCKETS - 1``) holds values in
``[MIN_S * GROWTH**(i-1), MIN_S * GROWTH**i)``; bucket 0 holds everything below
``MIN_S`` (and zero), the last bucket everything at or above ``MAX_S``. With
``GROWTH = 2**(1/4)`` a quantile read at the bucket's geometric midpoint is within
about ±9 % of the true value. Histograms with the same constants merge by adding
counts, so the controller can combine workers exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["LogHistogram", "MIN_S", "MAX_S", "GROWTH", "N_BUCKETS", "bucket_bounds"]

#: Lower edge of the first regular bucket, seconds (100 µs).
MIN_S = 1e-4
#: Ratio between successive bucket edges.
GROWTH = 2.0**0.25
#: Number of buckets, underflow and overflow included (edges up to about 6.6 min).
N_BUCKETS = 80
#: Lower edge of the overflow bucket, seconds.
MAX_S = MIN_S * GROWTH ** (N_BUCKETS - 2)
_INV_LOG_GROWTH = 1.0 / math.log(GROWTH)


def bucket_bounds(index: int) -> tuple[float, float]:
    """``(lower, upper)`` edges of bucket ``index``, seconds (0 and inf at the ends)."""
    if index <= 0:
        return 0.0, MIN_S
    if index >= N_BUCKETS - 1:
        return MAX_S, math.inf
    return MIN_S * GROWTH ** (index - 1), MIN_S * GROWTH**index


def _bucket_of(value_s: float) -> int:
    if not value_s >= MIN_S:  # also NaN
        return 0
    i = int(math.log(value_s / MIN_S) * _INV_LOG_GROWTH) + 1
    return i if i < N_BUCKETS - 1 else N_BUCKETS - 1


def _representative(index: int) -> float:
    lo, hi = bucket_bounds(index)
    if index <= 0:
        return MIN_S / 2
    if math.isinf(hi):
        return lo
    return math.sqrt(lo * hi)


class LogHistogram:
    """Counts of values in :data:`N_BUCKETS` log-spaced buckets, plus count, sum and max.

    Memory is fixed (a dict of at most :data:`N_BUCKETS` entries); :meth:`observe`
    is O(1).
    """

    __slots__ = ("counts", "count", "sum", "max")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.count = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, value_s: float) -> None:
        """Record one value (seconds); negative or NaN values count in bucket 0."""
        i = _bucket_of(value_s)
        self.counts[i] = self.counts.get(i, 0) + 1
        self.count += 1
        if value_s > 0.0:
            self.sum += value_s
            if value_s > self.max:
                self.max = value_s

    def merge_sparse(self, pairs: Iterable[tuple[int, int]], sum_s: float, max_s: float) -> None:
        """Add another histogram given as ``(bucket, count)`` pairs, its sum and max."""
        for i, n in pairs:
            if not 0 <= i < N_BUCKETS:
                raise ValueError(f"bucket index {i} outside [0, {N_BUCKETS})")
            self.counts[i] = self.counts.get(i, 0) + n
            self.count += n
        self.sum += sum_s
        self.max = max(self.max, max_s)

    def sparse(self) -> list[tuple[int, int]]:
        """Non-empty buckets as ``(index, count)``, in index order."""
        return sorted(self.counts.items())

    def quantile(self, q: float) -> float | None:
        """Approximate quantile ``q`` in [0, 1]: the geometric midpoint of its bucket.

        Capped at the largest value seen. None when empty.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q}")
        if self.count == 0:
            return None
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for i, n in sorted(self.counts.items()):
            seen += n
            if seen >= rank:
                return min(_representative(i), self.max) if self.max > 0 else 0.0
        return self.max  # pragma: no cover - counts always sum to count
