"""Watching the shared-memory weight table: new generations into a fleet.

:class:`TableWatcher` polls the table's generation and swaps in a new
:class:`~fastroute.proxy.path.fleet.FleetState` on change, keeping the last good one on any
error. With a :class:`~fastroute.proxy.background.start_table.StartTable`, the stale table found at
start is not adopted (the start rule, docs/operations.md "Stale tables at proxy start").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastroute.errors import TableError
from fastroute.tables import TableReader

if TYPE_CHECKING:
    from fastroute.proxy.background.start_table import StartTable
    from fastroute.proxy.path.fleet import Fleet, FleetState

__all__ = ["TableWatcher"]

logger = logging.getLogger(__name__)


class TableWatcher:
    """Poll a shared-memory weight table and feed new generations to a :class:`Fleet`.

    Parameters
    ----------
    fleet : Fleet
    name : str
        Segment name.
    interval_s : float
        Poll period (the generation is one atomic load; a snapshot is taken only
        when it changed).
    on_change : callable, optional
        Called with the new :class:`FleetState` after each swap.
    start : StartTable, optional
        The start rule's hold: the generation it rejected is skipped (no snapshot taken).
    """

    def __init__(
        self,
        fleet: Fleet,
        name: str,
        *,
        interval_s: float = 0.5,
        on_change: Callable[[FleetState], None] | None = None,
        start: StartTable | None = None,
    ) -> None:
        self.fleet = fleet
        self.name = name
        self.interval_s = interval_s
        self.on_change = on_change
        self.start = start
        self._reader: TableReader | None = None
        self._last_error: str | None = None
        self.last_generation = 0

    def poll(self) -> bool:
        """Check the table once; return True if a new generation was adopted."""
        try:
            if self._reader is None:
                self._reader = TableReader(self.name)
            else:
                self._reader.reattach_if_replaced()
            generation = self._reader.generation()
            if generation == 0 or generation == self.last_generation:
                return False
            if self.start is not None and self.start.holds(generation):
                return False  # the stale table found at start: capacity weights stay
            state = self.fleet.apply_snapshot(self._reader.snapshot())
        except (TableError, OSError, ValueError) as exc:
            if isinstance(exc, FileNotFoundError) and self._reader is None:
                return False  # no table (yet): the fallback weights stay
            text = f"{type(exc).__name__}: {exc}"
            if text != self._last_error:
                logger.warning(
                    "weight table %r unusable, keeping the last good: %s", self.name, text
                )
                self._last_error = text
            if self._reader is not None and not isinstance(exc, ValueError):
                self._reader.close()
                self._reader = None
            return False
        self._last_error = None
        self.last_generation = state.generation
        if self.start is not None:
            self.start.adopted(state.generation)
        logger.info("weight table %r: generation %d adopted", self.name, state.generation)
        if self.on_change is not None:
            self.on_change(state)
        return True

    async def run(self) -> None:
        """Poll forever (cancel to stop)."""
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                try:
                    self.poll()
                except Exception:  # never let a bad table stop the polling
                    logger.exception("weight table %r: unexpected error while polling", self.name)
        finally:
            self.close()

    def close(self) -> None:
        """Detach from the table."""
        if self._reader is not None:
            with contextlib.suppress(Exception):
                self._reader.close()
            self._reader = None
