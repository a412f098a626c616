"""Weight tables in the shared-memory directory whose writer is gone.

A table's writer holds an ``flock`` on ``<name>.lock`` while it lives (the kernel drops it when
the process dies), so a table whose lock can be taken has no writer: a proxy or controller that
died or was removed left it. :func:`find_stale` lists them with their age and controller epoch;
:func:`remove_stale` deletes them (``fastroute table stale [--remove]``).

:func:`judge_start` is the proxy's start rule (docs/operations.md "Stale tables at proxy start"):
whether a table found at start may steer requests before a live writer publishes into it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastroute.errors import TableError, TableLockedError
from fastroute.tables.reader import TableReader
from fastroute.tables.segment import WriterLock, segment_path, shm_dir

__all__ = [
    "StaleTable",
    "StartVerdict",
    "describe",
    "find_stale",
    "inspect_start",
    "judge_start",
    "remove_stale",
]

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


def describe(name: str) -> StaleTable | None:
    """The table ``name`` with its age and epoch; None if it is not a readable weight table."""
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


def _writer_alive(name: str) -> bool:
    """Someone holds the table's writer lock (we take and drop it at once otherwise)."""
    try:
        lock = WriterLock(segment_path(name))
    except TableLockedError:
        return True
    lock.release()
    return False


def find_stale(min_age_s: float = 0.0) -> list[StaleTable]:
    """Weight tables whose writer is gone and that are at least ``min_age_s`` old."""
    out = []
    for name in _candidates():
        table = describe(name)
        if table is None or table.age_s < min_age_s or _writer_alive(name):
            continue  # not a table, too young, or a live writer owns it
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


@dataclass(frozen=True, slots=True)
class StartVerdict:
    """What the start rule decided about a table found at start.

    Attributes
    ----------
    table : StaleTable
        The table (name, generation, age and epoch when judged).
    writer_alive : bool
        Its writer lock was held when judged.
    use : bool
        It may steer requests now; False: capacity weights until a live writer publishes.
    reason : str
        ``fresh`` (no writer, not older than the bound, no controller to ask: used),
        ``too_old`` (older than the bound: not used) or ``unconfirmed`` (this proxy pulls from
        a controller: not used before the controller's first table replaces it).
    """

    table: StaleTable
    writer_alive: bool
    use: bool
    reason: str


def judge_start(
    table: StaleTable, writer_alive: bool, *, max_age_s: float, pulls: bool
) -> StartVerdict | None:
    """The start rule: None when ``table`` is current, else the verdict on it.

    A table with a live writer is current (a controller on this host, or a sibling worker's
    puller); one exception: a proxy that ``pulls`` has no controller on its host, so the writer is
    a sibling's puller that may not have pulled yet, and a table older than ``max_age_s`` is
    treated as writer-less. A writer-less table is used only when it is at most ``max_age_s`` old
    and this proxy has no controller to confirm it with (``pulls`` False); a puller's first table
    replaces it (its epoch is not trusted: see :class:`~fastroute.tables.TableWriter` fencing).
    """
    old = table.age_s > max_age_s
    if writer_alive and not (pulls and old):
        return None
    if old:
        return StartVerdict(table, writer_alive, False, "too_old")
    if pulls:
        return StartVerdict(table, writer_alive, False, "unconfirmed")
    return StartVerdict(table, writer_alive, True, "fresh")


def inspect_start(name: str) -> tuple[StaleTable, bool] | None:
    """The table ``name`` as the start rule sees it and whether its writer lives; None when
    there is no table to judge (absent, never published, or not a weight table)."""
    table = describe(name)
    if table is None or table.generation == 0:
        return None
    return table, _writer_alive(name)
