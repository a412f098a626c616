"""When streams leave a draining engine: one hand-off time per engine, compared per chunk.

An engine starts draining for this worker's fleet when the weight table flags it draining
or unavailable (:meth:`DrainMarks.follow`, from
:meth:`~fastroute.proxy.path.fleet.Fleet.apply_snapshot`) or when a config reload leaves
it out of the config in force (admin API drain or delete, DNS, the file:
:meth:`DrainMarks.mark`). Its hand-off time is then the moment the worker saw that plus
``retry.drain_handoff_after_s``; a stream relaying from it hands off at its first chunk
after that time (:mod:`fastroute.proxy.path.relay`, :mod:`fastroute.proxy.path.migration`).
The relay's per-chunk check is one list index and one float compare; nothing here runs
per chunk. See docs/failure-handling.md, "Mid-stream migration".
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable

import numpy as np

__all__ = ["DrainMarks", "NEVER", "loop_now"]

#: The hand-off time of an engine that is not draining.
NEVER = math.inf


def loop_now() -> float:
    """The running event loop's clock (the relay's ``now``), else ``time.monotonic()``."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class DrainMarks:
    """Per engine index, when streams relaying from it hand off (``inf``: never).

    Parameters
    ----------
    n_engines : int
    after_s : float
        ``retry.drain_handoff_after_s``: seconds from the drain to the hand-off; negative
        disables hand-offs (every time stays ``inf``).

    Attributes
    ----------
    handoff_at : list of float
        ``loop.time()`` at which a stream on engine ``i`` hands off; the relay reads
        ``handoff_at[i]`` per chunk. A plain list: indexing it is cheaper than numpy's.
    """

    __slots__ = ("handoff_at", "after_s", "_gone")

    def __init__(self, n_engines: int, after_s: float) -> None:
        self.handoff_at: list[float] = [NEVER] * n_engines
        self.after_s = after_s
        self._gone: set[int] = set()  # left the config: never available again here

    @property
    def enabled(self) -> bool:
        """Hand-offs are on (``retry.drain_handoff_after_s`` >= 0)."""
        return self.after_s >= 0

    def draining(self, index: int) -> bool:
        """Engine ``index`` is draining (its hand-off time is set)."""
        return self.handoff_at[index] != NEVER

    def gone(self, indices: Iterable[int], now: float | None = None) -> None:
        """Engines ``indices`` left the config in force at ``now``: draining for good (a
        later table that lists them available does not undo it)."""
        indices = list(indices)
        self._gone.update(indices)
        self.mark(indices, now)

    def mark(self, indices: Iterable[int], now: float | None = None) -> None:
        """Engines ``indices`` started draining at ``now`` (default :func:`loop_now`); an
        engine already draining keeps its earlier time."""
        if not self.enabled:
            return
        at = (loop_now() if now is None else now) + self.after_s
        handoff_at = self.handoff_at
        for i in indices:
            if handoff_at[i] == NEVER:
                handoff_at[i] = at

    def follow(self, available: np.ndarray, now: float | None = None) -> None:
        """Adopt a weight table's availability: engines not available are draining
        (from ``now`` if they were not already), available ones are not."""
        unavailable = np.flatnonzero(~available.astype(bool)).tolist()
        for i in np.flatnonzero(available).tolist():
            if i not in self._gone:
                self.handoff_at[i] = NEVER
        if unavailable:
            self.mark(unavailable, now)
