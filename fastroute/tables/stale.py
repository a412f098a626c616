"""Weight tables in the shared-memory directory whose writer is gone.

A table's writer holds an ``flock`` on ``<name>.lock`` while it lives (the kernel drops it when
the process dies), so a table whose lock can be taken has no writer: a proxy or controller that
died or was removed left it. :func:`find_stale` lists them with their age and controller epoch;
:func:`remove_stale` deletes them (``fastroute table stale [--remove]``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastroute.errors import TableError, TableLockedError
from fastroute.tables.reader import TableReader
from fastroute.tables.segment import WriterLock, segment_path, shm_dir

__all__ = ["StaleTable", "find_stale", "remove_stale"]

#: Bound on the directory entries examined (a shm directory holds a few dozen).
MAX_ENTRIES = 4096


@dataclass(frozen=True, slots=True)
class StaleTable:
    """A table without a live writer: name, generation, age in seconds, epoch (None: none)."""

    name: str
    generation: int
    age_s: float
    epoch: int | None


def _candidates() -> list[str]:
    names = []
    for i, path in enumerate(sorted(shm_dir().glob("*"))):
        if i >= MAX_ENTRIES:
            break
        if path.is_file() and not path.name.endswith((".lock", ".tmp")):
            names.append(path.name)
    return names


def _describe(name: str) -> StaleTable | None:
    try:
        with TableReader(name) as reader:
            if reader.generation() == 0:
                return StaleTable(name, 0, float("inf"), None)
            snap = reader.snapshot()
    except (TableError, ValueError, OSError):
        return None  # not a weight table (a stats block, another file)
    epoch = snap.meta.get("epoch") if snap.meta_bytes else None
    age_s = max(0.0, time.time() - snap.published_at)
    return StaleTable(name, snap.generation, age_s, epoch if isinstance(epoch, int) else None)


def find_stale(min_age_s: float = 0.0) -> list[StaleTable]:
    """Weight tables whose writer is gone and that are at least ``min_age_s`` old."""
    out = []
    for name in _candidates():
        table = _describe(name)
        if table is None or table.age_s < min_age_s:
            continue
        try:
            lock = WriterLock(segment_path(name))
        except TableLockedError:
            continue  # a live writer owns it
        lock.release()
        out.append(table)
    return out


def remove_stale(tables: list[StaleTable]) -> list[str]:
    """Delete each table (under its writer lock, so a writer that started since is safe)."""
    removed = []
    for table in tables:
        path = segment_path(table.name)
        try:
            lock = WriterLock(path)
        except TableLockedError:
            continue
        try:
            path.unlink(missing_ok=True)
            removed.append(table.name)
        finally:
            lock.release(unlink=True)
    return removed
