"""The weight table a proxy finds at start: current, or left behind by a writer that is gone.

:class:`StartTable` applies :func:`fastroute.tables.stale.judge_start` once, when the app starts
(before its first table poll and before its puller takes the writer lock), and then tells every
:class:`~fastroute.proxy.background.table_watch.TableWatcher` of the app (reloads included) whether
the table's generation found at start may be adopted. Any other generation is a live writer's
publication and ends the hold. Nothing here runs on the request path: the watcher asks at poll
time, ``/ready`` reads :meth:`StartTable.ready_info`.
"""

from __future__ import annotations

import logging
import time

from fastroute.tables.stale import StartVerdict, inspect_start, judge_start

__all__ = ["StartTable"]

logger = logging.getLogger(__name__)


class StartTable:
    """The start rule's verdict on one table, held until a live writer publishes.

    Parameters
    ----------
    name : str
        The weight table's segment name.
    max_age_s : float
        ``proxy.stale_table_max_age_s``: the oldest writer-less table used at start.
    pulls : bool
        This proxy pulls its table from a controller (``proxy.controller_url``): a writer-less
        table waits for the controller's first table instead of being used.

    Attributes
    ----------
    verdict : StartVerdict or None
        None: no table found, or a current one, or a live writer has published since.
    """

    def __init__(self, name: str, *, max_age_s: float, pulls: bool) -> None:
        self.name = name
        self.max_age_s = max_age_s
        self.pulls = pulls
        self.verdict: StartVerdict | None = None
        self._judged_at = time.monotonic()

    def judge(self) -> StartVerdict | None:
        """Look at the table now (once, at start); log one warning when it is stale."""
        found = inspect_start(self.name)
        self._judged_at = time.monotonic()
        if found is None:
            self.verdict = None
            return None
        self.verdict = judge_start(found[0], found[1], max_age_s=self.max_age_s, pulls=self.pulls)
        if self.verdict is not None:
            self._warn(self.verdict)
        return self.verdict

    def _warn(self, v: StartVerdict) -> None:
        t = v.table
        what = {
            "fresh": "routing on it (no controller to confirm it)",
            "too_old": f"older than proxy.stale_table_max_age_s = {self.max_age_s:g} s: "
            "routing on config capacity weights until a live table arrives",
            "unconfirmed": "routing on config capacity weights until the controller's first "
            "table replaces it",
        }[v.reason]
        logger.warning(
            "weight table %r found at start has no live writer (generation %d, %.1f s old, "
            "epoch %s): %s; if no controller will write it again, remove it with "
            "`fastroute table stale --remove`",
            t.name,
            t.generation,
            t.age_s,
            "none" if t.epoch is None else t.epoch,
            what,
        )

    def holds(self, generation: int) -> bool:
        """The watcher must not adopt ``generation``: it is the rejected table found at start."""
        v = self.verdict
        return v is not None and not v.use and generation == v.table.generation

    def adopted(self, generation: int) -> None:
        """A watcher adopted ``generation``; another one than found at start ends the hold."""
        v = self.verdict
        if v is not None and generation != v.table.generation:
            logger.info(
                "weight table %r: generation %d published by a live writer replaces the stale "
                "table found at start",
                self.name,
                generation,
            )
            self.verdict = None

    def ready_info(self) -> dict[str, object] | None:
        """``/ready``'s ``stale_table``: name, age now, epoch, reason, used; None when current."""
        v = self.verdict
        if v is None:
            return None
        age_s = v.table.age_s + (time.monotonic() - self._judged_at)
        return {
            "name": v.table.name,
            "generation": v.table.generation,
            "age_s": round(age_s, 3),
            "epoch": v.table.epoch,
            "reason": v.reason,
            "used": v.use,
        }
