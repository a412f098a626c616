"""Shared-memory routing state: the weight table and the per-engine stats block.

* :class:`TableWriter` publishes weight tables (double buffer + generation seqlock);
* :class:`TableSnapshot` is one validated table (:meth:`TableSnapshot.validated`);
* :class:`TableReader` takes consistent :class:`TableSnapshot` copies from any process;
* :class:`StatsBlock` holds per-engine in-flight counts and latency EWMAs that
  every worker updates atomically.

The byte layout lives in :mod:`fastroute.tables.layout` and ``docs/table-format.md``.
"""

from fastroute.tables.layout import FLAG_DRAINING, FLAG_UNAVAILABLE, Counter, Ewma
from fastroute.tables.reader import TableReader
from fastroute.tables.snapshot import DEFAULT_RETRY_RATIO, TableSnapshot, check_weights
from fastroute.tables.stats import StatsBlock
from fastroute.tables.writer import TableWriter

__all__ = [
    "TableWriter",
    "TableReader",
    "TableSnapshot",
    "StatsBlock",
    "Counter",
    "Ewma",
    "FLAG_UNAVAILABLE",
    "FLAG_DRAINING",
    "DEFAULT_RETRY_RATIO",
    "check_weights",
]
