"""This worker's in-flight count per engine, and the caps on it (``max_concurrency``).

An engine with ``max_concurrency = N`` gets at most N attempts in flight from one
proxy worker. At its cap it is skipped for new picks like an ejected engine (the
eligibility mask leaves it out, the decision record says ``at_cap``). When every
candidate of a request is at its cap, the request waits for one to free up — it
already holds an admission slot, so the waiters are bounded by
``limits.max_concurrent_requests`` — for at most ``admission.max_wait_s``, then gets
429 with ``Retry-After``.

The counts are this worker's own (the cap is per worker, as the config documents),
not the host-wide ``IN_FLIGHT`` column of the stats block; they are also what the
worker's reports to the controller carry, so that the reports of a host's workers
add up to the host's in-flight count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

__all__ = ["ConcurrencyCaps"]


class ConcurrencyCaps:
    """In-flight counts of one worker against each engine's cap.

    Parameters
    ----------
    caps : sequence of int or None
        ``max_concurrency`` of each engine, fleet order; None: no cap.
    """

    def __init__(self, caps: Sequence[int | None]) -> None:
        self.enabled = any(c is not None for c in caps)
        self._caps = [c if c is not None else 0 for c in caps]
        self._counts = [0] * len(caps)
        self.at_cap = np.zeros(len(caps), dtype=bool)
        self.available = np.ones(len(caps), dtype=bool)  # ~at_cap, read-only view for masks
        self.available.flags.writeable = False
        #: Bumped whenever an engine reaches or leaves its cap (eligibility caches key on it).
        self.version = 0
        self._freed: asyncio.Event | None = None

    def count(self, index: int) -> int:
        """This worker's attempts in flight to engine ``index``."""
        return self._counts[index]

    def cap(self, index: int) -> int | None:
        """Engine ``index``'s cap, or None."""
        return self._caps[index] or None

    def counts(self) -> list[int]:
        """This worker's attempts in flight, per engine (a copy)."""
        return list(self._counts)

    def started(self, index: int) -> None:
        """An attempt to engine ``index`` started."""
        n = self._counts[index] = self._counts[index] + 1
        cap = self._caps[index]
        if cap and n >= cap and not self.at_cap[index]:
            self._set(index, True)

    def finished(self, index: int) -> None:
        """An attempt to engine ``index`` ended (any way)."""
        n = self._counts[index] = self._counts[index] - 1
        if self.at_cap[index] and n < self._caps[index]:
            self._set(index, False)
            if self._freed is not None:
                self._freed.set()  # wake every waiter: each re-picks
                self._freed = None

    def _set(self, index: int, at_cap: bool) -> None:
        self.at_cap[index] = at_cap
        available = ~self.at_cap
        available.flags.writeable = False
        self.available = available
        self.version += 1

    async def wait_freed(self, timeout_s: float) -> bool:
        """Wait until some engine leaves its cap; False after ``timeout_s``."""
        if timeout_s <= 0:
            return False
        if self._freed is None:
            self._freed = asyncio.Event()
        try:
            await asyncio.wait_for(self._freed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
