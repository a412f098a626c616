"""Per-engine live statistics of a fleet: in-flight counts, request/failure totals,
in-band latency EWMAs.

:class:`EngineStats` counts over the host's shared-memory
:class:`~fastroute.tables.StatsBlock` when the proxy runs as supervised workers (every
worker sees every worker's in-flight requests; updates are atomic), else in private
per-process arrays. Engines the block does not list (added by a config reload after the
block was created) always use the private counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from fastroute.guards.outlier import Outcome, OutlierDetector
from fastroute.tables.stats import DEFAULT_EWMA_ALPHA, Counter, Ewma, StatsBlock

__all__ = ["FAILURE_OUTCOMES", "EngineStats", "InFlightCounts", "CountingOutlierDetector"]

#: Column of each EWMA in the local (unshared) EWMA array, in ``Ewma`` order.
_EWMA_COLUMN = {e: i for i, e in enumerate(Ewma)}

#: Attempt outcomes counted as FAILURES in the stats block.
FAILURE_OUTCOMES = frozenset({Outcome.HTTP_5XX, Outcome.CONNECT_ERROR, Outcome.TIMEOUT})


class EngineStats:
    """Per-engine live statistics of one fleet, shared between workers when possible.

    Parameters
    ----------
    engine_ids : ndarray of uint64
        The fleet's engine ids, in fleet (config) order.
    block : StatsBlock, optional
        The host's shared stats block. Engines it lists are counted there (atomically,
        visible to every worker); the others, and all engines without a block, in
        private arrays of this process.

    Attributes
    ----------
    shared : ndarray of bool
        Whether each engine has a slot in the shared block.
    """

    def __init__(self, engine_ids: np.ndarray, block: StatsBlock | None = None) -> None:
        n = len(engine_ids)
        self.block = block
        slots = np.full(n, -1, dtype=np.intp)
        if block is not None:
            for i, eid in enumerate(engine_ids):
                with contextlib.suppress(KeyError):
                    slots[i] = block.slot(int(eid))
        self.slots = slots
        # The same as Python ints: indexing a numpy array and int() of the scalar cost
        # more than the counter update itself, five times per request.
        self._slot_of: list[int] = [int(x) for x in slots]
        self.shared = slots >= 0
        self._shared_idx = np.flatnonzero(self.shared)
        self._shared_slots = slots[self.shared]
        self._all_shared = bool(self.shared.all())
        self._column = block.column(Counter.IN_FLIGHT) if block is not None else None
        self._token_column = block.column(Counter.IN_FLIGHT_TOKENS) if block is not None else None
        self._queued_column = block.column(Counter.QUEUED_TOKENS) if block is not None else None
        self._peer_column = block.column(Counter.PEER_QUEUED_TOKENS) if block is not None else None
        self._local_in_flight = np.zeros(n, dtype=np.int64)
        self._local_tokens = np.zeros(n, dtype=np.int64)
        self._local_queued = np.zeros(n, dtype=np.int64)
        self._local_peer = np.zeros(n, dtype=np.int64)
        self._local_requests = np.zeros(n, dtype=np.int64)
        self._local_failures = np.zeros(n, dtype=np.int64)
        self._local_ewma = np.full((n, len(Ewma)), np.nan)

    def add_in_flight(self, index: int, delta: int, tokens: int = 0) -> None:
        """Add ``delta`` requests and ``tokens`` tokens to engine ``index``'s in-flight
        counts (atomic when shared)."""
        slot = self._slot_of[index]
        if slot >= 0:
            assert self.block is not None
            self.block.add(slot, Counter.IN_FLIGHT, delta)
            if tokens:
                self.block.add(slot, Counter.IN_FLIGHT_TOKENS, tokens)
        else:
            self._local_in_flight[index] += delta
            self._local_tokens[index] += tokens

    def add_queued(self, index: int, tokens: int) -> None:
        """Add ``tokens`` (negative: remove) to engine ``index``'s queued prompt tokens
        (atomic when shared)."""
        slot = self._slot_of[index]
        if slot >= 0:
            assert self.block is not None
            self.block.add(slot, Counter.QUEUED_TOKENS, tokens)
        else:
            self._local_queued[index] += tokens

    def in_flight_of(self, index: int) -> int:
        """Engine ``index``'s current in-flight count (all workers when shared)."""
        slot = self._slot_of[index]
        if slot >= 0:
            assert self.block is not None
            return self.block.get(slot, Counter.IN_FLIGHT)
        return int(self._local_in_flight[index])

    def in_flight(self) -> np.ndarray:
        """A fresh int64 copy of the in-flight counts in fleet order."""
        return self._gather(self._column, self._local_in_flight)

    def in_flight_tokens(self) -> np.ndarray:
        """A fresh int64 copy of the in-flight tokens (prompt + output budget) in fleet
        order, every worker's when shared."""
        return self._gather(self._token_column, self._local_tokens)

    def queued_tokens(self) -> np.ndarray:
        """A fresh int64 copy of the queued prompt tokens (attempts in flight without a
        first token yet) in fleet order, every worker's when shared, and the other proxies'
        when polled (:meth:`set_peer_queued`)."""
        return self._gather(self._queued_column, self._local_queued)

    def own_queued_tokens(self) -> np.ndarray:
        """:meth:`queued_tokens` without the other proxies' (what this host queued)."""
        return self.queued_tokens() - self.peer_queued()

    def peer_queued(self) -> np.ndarray:
        """A fresh int64 copy of the prompt tokens the other proxies have queued per engine,
        as this host's peer poller last wrote them (:meth:`set_peer_queued`)."""
        return self._gather(self._peer_column, self._local_peer)

    def set_peer_queued(self, tokens: np.ndarray) -> None:
        """Replace the other proxies' queued prompt tokens (fleet order): each engine's
        ``PEER_QUEUED_TOKENS`` and ``QUEUED_TOKENS`` move by the difference to the last
        value, so that :meth:`queued_tokens`, which the request path reads, costs nothing
        more. One writer per host (the peer poller holding the host's lock); the own
        attempts' updates of ``QUEUED_TOKENS`` are atomic adds and commute with these."""
        block = self.block
        current = self.peer_queued()
        for index in np.flatnonzero(current != tokens).tolist():
            slot = self._slot_of[index]
            if slot >= 0:
                assert block is not None
                delta = int(tokens[index]) - block.get(slot, Counter.PEER_QUEUED_TOKENS)
                block.add(slot, Counter.PEER_QUEUED_TOKENS, delta)
                block.add(slot, Counter.QUEUED_TOKENS, delta)
            else:
                delta = int(tokens[index]) - int(self._local_peer[index])
                self._local_peer[index] += delta
                self._local_queued[index] += delta

    def _gather(self, column: np.ndarray | None, local: np.ndarray) -> np.ndarray:
        """One counter in fleet order: the shared block's column where the engine has a
        slot, this process's ``local`` array elsewhere."""
        if column is not None and self._all_shared:
            return column[self._shared_slots]  # fancy indexing: already a copy
        out = local.copy()
        if column is not None and self._shared_idx.size:
            out[self._shared_idx] = column[self._shared_slots]
        return out

    def record_outcome(self, index: int, outcome: Outcome) -> None:
        """Count one finished attempt (REQUESTS, and FAILURES for 5xx/connect/timeout)."""
        failed = outcome in FAILURE_OUTCOMES
        slot = self._slot_of[index]
        if slot >= 0:
            assert self.block is not None
            self.block.add(slot, Counter.REQUESTS, 1)
            if failed:
                self.block.add(slot, Counter.FAILURES, 1)
            self.block.observe(slot, Ewma.FAILURE_RATE, 1.0 if failed else 0.0)
        else:
            self._local_requests[index] += 1
            self._local_failures[index] += int(failed)
            self._fold(index, Ewma.FAILURE_RATE, 1.0 if failed else 0.0)

    def observe(self, index: int, ewma: Ewma, sample: float) -> None:
        """Fold a latency sample (seconds) into engine ``index``'s EWMA."""
        slot = self._slot_of[index]
        if slot >= 0:
            assert self.block is not None
            self.block.observe(slot, ewma, sample)
        else:
            self._fold(index, ewma, sample)

    def _fold(self, index: int, ewma: Ewma, sample: float) -> None:
        col = _EWMA_COLUMN[ewma]
        old = self._local_ewma[index, col]
        alpha = DEFAULT_EWMA_ALPHA
        self._local_ewma[index, col] = sample if np.isnan(old) else old + alpha * (sample - old)

    def totals(self, index: int) -> tuple[int, int]:
        """(REQUESTS, FAILURES) of engine ``index``."""
        slot = self._slot_of[index]
        if slot >= 0:
            assert self.block is not None
            return (
                self.block.get(slot, Counter.REQUESTS),
                self.block.get(slot, Counter.FAILURES),
            )
        return int(self._local_requests[index]), int(self._local_failures[index])

    def ewma(self, index: int, ewma: Ewma) -> float:
        """Engine ``index``'s EWMA (NaN before its first sample)."""
        slot = self._slot_of[index]
        if slot >= 0:
            assert self.block is not None
            return self.block.ewma(slot, ewma)
        return float(self._local_ewma[index, list(Ewma).index(ewma)])


class InFlightCounts:
    """``fleet.in_flight``: per-engine in-flight counts as an indexable object.

    ``counts[i]`` reads engine ``i``'s count; ``counts[i] += d`` becomes one atomic
    ``add(+d)`` (the read records what it returned, the write adds the difference), so
    the request path's augmented assignments stay correct across worker processes as
    long as nothing awaits between the read and the write (true for ``+=`` in one
    thread). Prefer :meth:`Fleet.attempt_started` / :meth:`Fleet.attempt_finished`.
    """

    __slots__ = ("_stats", "_read")

    def __init__(self, stats: EngineStats) -> None:
        self._stats = stats
        self._read: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._stats.slots)

    def __getitem__(self, index: int) -> int:
        value = self._stats.in_flight_of(int(index))
        self._read[int(index)] = value
        return value

    def __setitem__(self, index: int, value: int) -> None:
        index = int(index)
        if index not in self._read:
            raise TypeError("in-flight counts change only by += / -= (or Fleet.attempt_*)")
        self._stats.add_in_flight(index, int(value) - self._read.pop(index))

    def __iter__(self) -> Iterator[int]:
        return iter(self._stats.in_flight().tolist())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = self._stats.in_flight()
        return out if dtype is None else out.astype(dtype)


class CountingOutlierDetector(OutlierDetector):
    """An :class:`OutlierDetector` that also counts outcomes in an :class:`EngineStats`."""

    def __init__(self, stats: EngineStats, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stats = stats

    def record(self, engine: int, outcome: Outcome, now_s: float) -> bool:
        self._stats.record_outcome(engine, outcome)
        return super().record(engine, outcome, now_s)
