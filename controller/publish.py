"""Publishing the plan: the shared-memory table, the wire snapshot and its long-poll.

:class:`TablePublisher` owns the local table (``TableWriter(table_name)``) and the snapshot of the
generation in force, which ``GET /v1/table`` serves and long-polls wait on
(:meth:`TablePublisher.wait_changed`). A plan whose table content equals the one in force is not
published again (:meth:`TablePublisher.unchanged`) until the table is ``republish_after_s`` old: a
heartbeat, so the data planes' table age tells a live controller from a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from controller.model import FleetModel, Plan
from fastroute.errors import TableError
from fastroute.tables import TableSnapshot, TableWriter

__all__ = ["TablePublisher"]

FloatArray = npt.NDArray[np.float64]


class TablePublisher:
    """The weight table one controller writes, and the snapshot in force.

    Parameters
    ----------
    table_name : str
        Shared-memory table to write.
    clock : callable
        Unix seconds: ``published_at`` of the snapshots, the table's age.
    republish_after_s : float
        Age in seconds from which an unchanged plan is published again (a config reload may
        change it).

    Attributes
    ----------
    writer : TableWriter or None
        None until :meth:`open`, after :meth:`close`.
    snapshot : TableSnapshot or None
        The generation in force (None before the first publish).
    row_clusters : tuple of str
        The cluster (region) of each row of :attr:`snapshot`, set with it: ``GET
        /v1/table?cluster=`` serves a region its own rows (:mod:`controller.region_tables`).
    """

    def __init__(
        self, table_name: str, clock: Callable[[], float], republish_after_s: float
    ) -> None:
        self.table_name = table_name
        self.clock = clock
        self.republish_after_s = republish_after_s
        self.writer: TableWriter | None = None
        self.snapshot: TableSnapshot | None = None
        self.row_clusters: tuple[str, ...] = ()
        self._changed = asyncio.Event()

    def open(self, n_engines: int, n_classes: int) -> None:
        """Open (or take over) the table; raises ``TableLockedError`` if another writer holds it."""
        if self.writer is None:
            self.writer = TableWriter(
                self.table_name,
                max_engines=max(4096, n_engines),
                max_classes=max(1024, n_classes),
            )

    def close(self) -> None:
        """Stop writing. The table file stays: proxies keep routing on the last weights."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def unchanged(
        self,
        prev: Plan | None,
        w: FloatArray,
        sigma: FloatArray,
        retry: float,
        flags: npt.NDArray[np.uint8],
    ) -> bool:
        """Whether ``prev`` (the plan in force) already publishes this table content, bitwise, and
        the table in force is younger than ``republish_after_s``."""
        return (
            prev is not None
            and self.snapshot is not None
            and prev.retry_ratio == retry
            and np.array_equal(prev.weights, w)
            and np.array_equal(prev.shed_fraction, sigma)
            and prev.engine_flags is not None
            and np.array_equal(prev.engine_flags, flags)
            and self.clock() - self.snapshot.published_at < self.republish_after_s
        )

    async def publish(
        self,
        model: FleetModel,
        w: FloatArray,
        sigma: FloatArray,
        retry: float,
        meta: dict[str, Any],
        flags: npt.NDArray[np.uint8],
    ) -> TableSnapshot:
        """Write a new generation (in a worker thread); it becomes :attr:`snapshot`."""
        snap = await asyncio.to_thread(self._publish, model, w, sigma, retry, meta, flags)
        self.snapshot = snap
        self.row_clusters = tuple(c.cluster for c in model.classes)
        return snap

    def notify_changed(self) -> None:
        """Wake the long-polls parked in :meth:`wait_changed` (a new generation is in force)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _publish(
        self,
        model: FleetModel,
        w: FloatArray,
        sigma: FloatArray,
        retry: float,
        meta: dict[str, Any],
        flags: npt.NDArray[np.uint8] | None = None,
    ) -> TableSnapshot:
        if self.writer is None:
            raise TableError("the table is not open")
        snap = TableSnapshot.validated(
            self.writer.generation + 1,
            model.engine_ids,
            w,
            class_keys=model.class_keys,
            engine_flags=flags,
            shed_fraction=sigma,
            retry_ratio=retry,
            published_at=self.clock(),
            meta=meta,
        )
        self.writer.write(snap)  # the same object the HTTP side serves
        return snap

    @property
    def generation(self) -> int:
        """Generation of the current snapshot, 0 before the first."""
        return 0 if self.snapshot is None else self.snapshot.generation

    async def wait_changed(
        self, after: int, timeout_s: float, epoch: str | None = None
    ) -> TableSnapshot | None:
        """The current snapshot once its generation differs from ``after`` or, when the poller
        names its ``epoch``, its epoch differs (a new leader's generations are its own counter:
        its first one may equal the old leader's ``after``); None on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.snapshot is None or (
            self.snapshot.generation == after
            and (epoch is None or str(self.snapshot.meta.get("epoch")) == epoch)
        ):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self.snapshot
