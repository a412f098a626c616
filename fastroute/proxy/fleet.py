"""The proxy's view of the fleet: engines, class rows, weights, availability.

Engines are the config's ``[[engines]]``, in file order: that order is the engine
index everywhere in the proxy (selector, outlier detector, in-flight counts), so a
new weight table never re-indexes local state. Class rows are one per
(model, priority) of the config's models.

Weights come from one of two sources (DESIGN.md §2):

* the shared-memory weight table ``proxy.table_name``, when it exists: each row is
  looked up by :func:`class_key` ``(proxy.cluster, model, priority)`` and its weights
  are mapped onto the config's engines by engine id (``hashing.engine_id(name)``);
  engines the table does not list get weight 0 in that row, engines the config does
  not list are ignored (the proxy has no address for them), a row the table lacks
  falls back to capacity weights; the table's engine flags and shed fractions apply;
* otherwise capacity-proportional weights: in each row, every engine serving the
  row's model (role ``both``) with weight ``capacity_rps``.

:class:`TableWatcher` polls the table's generation and swaps in a new
:class:`FleetState` on change, keeping the last good one on any error.

In-flight counts, request/failure totals and in-band latency EWMAs live in an
:class:`EngineStats`: over the host's shared-memory :class:`~fastroute.tables.StatsBlock`
when the proxy runs as supervised workers (every worker sees every worker's in-flight
requests; updates are atomic), else in private per-process arrays. Engines the block
does not list (added by a config reload after the block was created) always use the
private counts.

Residency and tenant hardware are hard filters applied per request on top of the
class row (:meth:`Fleet.request_mask`), so one row serves every tenant. Eligibility
for a request = weight > 0 in its row AND allowed by the controller's flags AND not
ejected by the local :class:`~fastroute.guards.outlier.OutlierDetector` AND in an
allowed zone (and hardware class, if the tenant has one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fastroute._core import Selector
from fastroute._core.selector_py import ZERO_WEIGHT_RATIO
from fastroute.config import PRIORITIES, Config, EngineConfig
from fastroute.errors import TableError
from fastroute.guards.outlier import Outcome, OutlierDetector
from fastroute.hashing import class_key, engine_id
from fastroute.proxy.concurrency import ConcurrencyCaps
from fastroute.tables import TableReader, TableSnapshot
from fastroute.tables.stats import DEFAULT_EWMA_ALPHA, Counter, Ewma, StatsBlock

__all__ = [
    "class_key",
    "EngineStats",
    "InFlightCounts",
    "FleetState",
    "Fleet",
    "RequestView",
    "LoadView",
    "TableWatcher",
]

if TYPE_CHECKING:
    from fastroute.policy.marginal import EngineState
    from fastroute.proxy.engine_load import EngineLoad

logger = logging.getLogger(__name__)

#: Column of each EWMA in the local (unshared) EWMA array, in ``Ewma`` order.
_EWMA_COLUMN = {e: i for i, e in enumerate(Ewma)}

#: Most distinct (zones, hardware) request masks cached.
MAX_CACHED_MASKS = 1024


@dataclass(frozen=True, slots=True, eq=False)
class FleetState:
    """One immutable set of weights and flags over the config's engines.

    Attributes
    ----------
    generation : int
        Weight-table generation; 0 for the config fallback.
    published_at : float or None
        Unix publish time of the table; None for the fallback.
    weights : ndarray of float64, shape (n_rows, n_engines)
    positive : ndarray of bool, shape (n_rows, n_engines)
        Weight counts as > 0 (the selector's own threshold).
    available : ndarray of bool, shape (n_engines,)
        Not flagged unavailable or draining by the controller.
    shed_fraction : ndarray of float64, shape (n_rows,)
    retry_ratio : float or None
        The controller's retry ratio; None for the fallback.
    selector : Selector
        Over ``weights``.
    """

    generation: int
    published_at: float | None
    weights: np.ndarray
    positive: np.ndarray
    available: np.ndarray
    shed_fraction: np.ndarray
    retry_ratio: float | None
    selector: Any

    @property
    def source(self) -> str:
        """``"table"`` or ``"config"``."""
        return "config" if self.generation == 0 else "table"


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
        self._local_in_flight = np.zeros(n, dtype=np.int64)
        self._local_requests = np.zeros(n, dtype=np.int64)
        self._local_failures = np.zeros(n, dtype=np.int64)
        self._local_ewma = np.full((n, len(Ewma)), np.nan)

    def add_in_flight(self, index: int, delta: int) -> None:
        """Add ``delta`` to engine ``index``'s in-flight count (atomic when shared)."""
        slot = self._slot_of[index]
        if slot >= 0:
            assert self.block is not None
            self.block.add(slot, Counter.IN_FLIGHT, delta)
        else:
            self._local_in_flight[index] += delta

    def in_flight_of(self, index: int) -> int:
        """Engine ``index``'s current in-flight count (all workers when shared)."""
        slot = self._slot_of[index]
        if slot >= 0:
            assert self.block is not None
            return self.block.get(slot, Counter.IN_FLIGHT)
        return int(self._local_in_flight[index])

    def in_flight(self) -> np.ndarray:
        """A fresh int64 copy of the in-flight counts in fleet order."""
        if self._column is not None and self._all_shared:
            return self._column[self._shared_slots]  # fancy indexing: already a copy
        out = self._local_in_flight.copy()
        if self._column is not None and self._shared_idx.size:
            out[self._shared_idx] = self._column[self._shared_slots]
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


class _CountingOutlierDetector(OutlierDetector):
    """An :class:`OutlierDetector` that also counts outcomes in an :class:`EngineStats`."""

    def __init__(self, stats: EngineStats, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stats = stats

    def record(self, engine: int, outcome: Outcome, now_s: float) -> bool:
        self._stats.record_outcome(engine, outcome)
        return super().record(engine, outcome, now_s)


class Fleet:
    """Engines, class rows and the current :class:`FleetState`, plus local health.

    Parameters
    ----------
    config : Config
        The validated configuration.
    clock : callable, optional
        Monotonic seconds for the outlier detector (default ``time.monotonic``).
    stats_block : StatsBlock, optional
        The host's shared stats block (supervised workers); default private counts.
    """

    def __init__(
        self,
        config: Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        stats_block: StatsBlock | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.engines: tuple[EngineConfig, ...] = config.engines
        self.names = [e.name for e in self.engines]
        self.engine_ids = np.array([engine_id(e.name) for e in self.engines], dtype=np.uint64)
        self._index_of_id = {int(i): n for n, i in enumerate(self.engine_ids)}
        self.models = config.models()
        self.rows: dict[tuple[str, str], int] = {}
        for model in self.models:
            for priority in PRIORITIES:
                self.rows[(model, priority)] = len(self.rows)
        self.row_keys = np.array(
            [class_key(config.proxy.cluster, m, p) for (m, p) in self.rows], dtype=np.uint64
        )
        self.zones = np.array([e.zone or "" for e in self.engines], dtype=object)
        self.hardware = np.array([e.hardware for e in self.engines], dtype=object)
        self._serves = np.zeros((len(self.rows), len(self.engines)), dtype=bool)
        self._fallback = np.zeros(self._serves.shape, dtype=np.float64)
        for (model, _), row in self.rows.items():
            for i, e in enumerate(self.engines):
                if model in e.models and e.role == "both":
                    self._serves[row, i] = True
                    self._fallback[row, i] = e.capacity_rps
        self.stats = EngineStats(self.engine_ids, stats_block)
        ej = config.ejection
        self.outlier: _CountingOutlierDetector = _CountingOutlierDetector(
            self.stats,
            len(self.engines),
            consecutive_failures=ej.consecutive_failures,
            base_ejection_s=ej.base_ejection_s,
            max_ejection_s=max(ej.max_ejection_s, ej.base_ejection_s),
            max_ejected_fraction=ej.max_ejected_fraction,
        )
        self.in_flight = InFlightCounts(self.stats)
        #: This worker's own in-flight counts and the ``max_concurrency`` caps.
        self.caps = ConcurrencyCaps([e.max_concurrency for e in self.engines])
        #: Prompt tokens of this worker's attempts in flight per engine (token-weighted
        #: policies: ``length-heuristic``, ``weighted-hrw`` with ``load = "tokens"``). A list:
        #: every attempt updates it (60 ns vs 230 for a numpy item), few policies read it.
        self.tokens_in_flight = [0] * len(self.engines)
        self._masks: dict[tuple[frozenset[str], str | None], np.ndarray] = {}
        # Eligibility masks by (row, id(request mask)) -> (request mask, mask), valid for
        # one (state, outlier version); the request mask is kept so its id stays unique.
        self._eligible: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._eligible_for: tuple[FleetState | None, int, int] = (None, -1, -1)
        self._reasons: tuple[int, dict[int, str]] = (-1, {})
        #: Per-engine load for the ``marginal-cost`` policy
        #: (:class:`~fastroute.proxy.engine_load.EngineLoad`); None unless a class uses it.
        self.load: EngineLoad | None = None
        self.state = self._make_state(0, None, self._fallback.copy(), None, None, None)

    @property
    def n_engines(self) -> int:
        """Number of engines."""
        return len(self.engines)

    def attempt_started(self, index: int, prompt_tokens: int = 0) -> None:
        """An attempt of ``prompt_tokens`` was sent to engine ``index``: in-flight + 1."""
        self.stats.add_in_flight(index, 1)
        self.caps.started(index)
        self.tokens_in_flight[index] += prompt_tokens

    def attempt_finished(self, index: int, prompt_tokens: int = 0) -> None:
        """An attempt to engine ``index`` ended (any way): in-flight - 1; pass the
        ``prompt_tokens`` it started with."""
        self.stats.add_in_flight(index, -1)
        self.caps.finished(index)
        self.tokens_in_flight[index] -= prompt_tokens

    def observe(self, index: int, ewma: Ewma, seconds: float) -> None:
        """Fold an in-band latency (``Ewma.TTFT_S``, ``TBOT_S``, ``E2E_S``) of engine
        ``index`` into the stats."""
        self.stats.observe(index, ewma, seconds)

    # -- weights -------------------------------------------------------------------------

    def _make_state(
        self,
        generation: int,
        published_at: float | None,
        weights: np.ndarray,
        available: np.ndarray | None,
        shed: np.ndarray | None,
        retry_ratio: float | None,
    ) -> FleetState:
        weights.flags.writeable = False
        row_max = weights.max(axis=1, keepdims=True) if weights.size else weights
        positive = (weights > 0) & (weights >= row_max * ZERO_WEIGHT_RATIO)
        return FleetState(
            generation=generation,
            published_at=published_at,
            weights=weights,
            positive=positive,
            available=np.ones(self.n_engines, dtype=bool) if available is None else available,
            shed_fraction=np.zeros(len(self.rows)) if shed is None else shed,
            retry_ratio=retry_ratio,
            selector=Selector(self.engine_ids, weights),
        )

    def state_from_snapshot(self, snap: TableSnapshot) -> FleetState:
        """Map a weight-table snapshot onto the config's engines and rows."""
        weights = self._fallback.copy()
        shed = np.zeros(len(self.rows))
        cols = [(n, self._index_of_id.get(int(i))) for n, i in enumerate(snap.engine_ids)]
        cols = [(t, c) for t, c in cols if c is not None]
        table_cols = np.array([t for t, _ in cols], dtype=np.intp)
        our_cols = np.array([c for _, c in cols], dtype=np.intp)
        for row, key in enumerate(self.row_keys):
            try:
                trow = snap.row(int(key))
            except KeyError:
                continue  # the controller has no row for this class: capacity weights
            weights[row, :] = 0.0
            weights[row, our_cols] = snap.weights[trow, table_cols]
            shed[row] = float(snap.shed_fraction[trow])
        weights[~self._serves] = 0.0  # never route a model to an engine not serving it
        available = np.ones(self.n_engines, dtype=bool)
        available[our_cols] = snap.available().astype(bool)[table_cols]
        return self._make_state(
            snap.generation,
            snap.published_at,
            weights,
            available,
            shed,
            float(snap.retry_ratio),
        )

    def apply_snapshot(self, snap: TableSnapshot) -> FleetState:
        """Adopt a new table generation; returns the new state."""
        self.state = self.state_from_snapshot(snap)
        return self.state

    # -- per-request eligibility -----------------------------------------------------------

    def request_mask(self, zones: frozenset[str], hardware: str | None) -> np.ndarray:
        """bool mask of engines in ``zones`` (and of ``hardware``, if given)."""
        key = (zones, hardware)
        mask = self._masks.get(key)
        if mask is None:
            mask = np.array([z in zones for z in self.zones], dtype=bool)
            if hardware is not None:
                mask &= self.hardware == hardware
            mask.flags.writeable = False
            if len(self._masks) >= MAX_CACHED_MASKS:
                self._masks.clear()
            self._masks[key] = mask
        return mask

    def view(self, request_mask: np.ndarray) -> RequestView:
        """A :class:`~fastroute.policy.FleetView` for one request."""
        return RequestView(self, self.state, request_mask)

    def load_view(self, request_mask: np.ndarray) -> LoadView:
        """A view that is also an ``EngineStateView`` (needs :attr:`load`)."""
        assert self.load is not None
        return LoadView(self, self.state, request_mask, self.load)

    def eligible(self, row: int, state: FleetState, request_mask: np.ndarray) -> np.ndarray:
        """uint8 mask: weight > 0 in ``row``, available, not ejected, not at its
        ``max_concurrency`` cap, in ``request_mask``.

        Cached per (row, request mask) for the current ``state``, outlier version and
        cap version: the inputs change rarely, and four numpy operations per request
        were a measurable share of the proxy's CPU.
        """
        version = self.outlier.version_at(self.clock())
        caps = self.caps
        cached_for = self._eligible_for
        if cached_for[0] is not state or cached_for[1] != version or cached_for[2] != caps.version:
            self._eligible = {}
            self._eligible_for = (state, version, caps.version)
        key = (row, id(request_mask))
        hit = self._eligible.get(key)
        if hit is not None and hit[0] is request_mask:
            return hit[1]
        ejected_ok = self.outlier.available_mask(self.clock()).astype(bool)
        mask = state.positive[row] & state.available & ejected_ok & request_mask
        if caps.enabled:
            mask &= caps.available
        out = mask.view(np.uint8)
        out.flags.writeable = False
        if len(self._eligible) >= MAX_CACHED_MASKS:
            self._eligible.clear()
        self._eligible[key] = (request_mask, out)
        return out

    def capped_out(self, row: int, state: FleetState, request_mask: np.ndarray) -> bool:
        """Whether some engine would be eligible for ``row`` but for its cap."""
        caps = self.caps
        if not caps.enabled or not caps.at_cap.any():
            return False
        ejected_ok = self.outlier.available_mask(self.clock()).astype(bool)
        mask = state.positive[row] & state.available & ejected_ok & request_mask
        return bool((mask & caps.at_cap).any())

    def cap_reasons(self) -> dict[int, str]:
        """Engines at their ``max_concurrency`` cap now, with why (empty without caps)."""
        caps = self.caps
        if not caps.enabled or not caps.at_cap.any():
            return {}
        return {
            int(i): f"{caps.count(int(i))} requests in flight from this worker, "
            f"max_concurrency {caps.cap(int(i))}"
            for i in np.flatnonzero(caps.at_cap)
        }

    def ejection_reasons(self) -> dict[int, str]:
        """Why each currently ejected engine is out; do not modify the result.

        Cached per outlier version: reasons change only with ejections.
        """
        version = self.outlier.version_at(self.clock())
        if self._reasons[0] != version:
            self._reasons = (version, self.outlier.reasons(self.clock()))
        return self._reasons[1]

    def explain(
        self,
        row: int,
        request_mask: np.ndarray,
        state: FleetState,
        reasons: dict[int, str] | None = None,
        at_cap: dict[int, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Why each engine of the fleet is not eligible for ``row`` (decision records).

        ``reasons``: the outlier detector's ejection reasons as of the decision
        (default: now). ``at_cap``: engines at their ``max_concurrency`` cap as of the
        decision, with why (default: now, :meth:`cap_reasons`).
        """
        if reasons is None:
            reasons = self.outlier.reasons(self.clock())
        if at_cap is None:
            at_cap = self.cap_reasons()
        out: list[dict[str, Any]] = []
        for i, name in enumerate(self.names):
            if not self._serves[row, i]:
                why, detail = "model", "does not serve the model (or is a P/D engine)"
            elif not state.positive[row, i]:
                why, detail = "weight", f"weight 0 in row {row} (generation {state.generation})"
            elif not state.available[i]:
                why, detail = "controller", "flagged unavailable or draining by the controller"
            elif not request_mask[i]:
                why, detail = "residency", f"zone {self.zones[i]!r} / hardware not allowed"
            elif i in reasons:
                why, detail = "ejected", reasons[i]
            elif i in at_cap:
                why, detail = "at_cap", at_cap[i]
            else:
                continue
            out.append({"engine": name, "filter": why, "detail": detail})
        return out


class RequestView:
    """The :class:`~fastroute.policy.FleetView` of one request over one fleet state.

    ``eligible(row)`` = weight > 0 in ``row`` AND available AND not ejected AND allowed
    by the request's residency/hardware mask.
    """

    __slots__ = ("_fleet", "_state", "_mask")

    def __init__(self, fleet: Fleet, state: FleetState, request_mask: np.ndarray) -> None:
        self._fleet = fleet
        self._state = state
        self._mask = request_mask

    @property
    def selector(self) -> Any:
        return self._state.selector

    @property
    def n_engines(self) -> int:
        return self._fleet.n_engines

    @property
    def state(self) -> FleetState:
        """The fleet state this view decides on."""
        return self._state

    def eligible(self, row: int) -> np.ndarray:
        return self._fleet.eligible(row, self._state, self._mask)

    def in_flight(self) -> np.ndarray:
        """In-flight counts in fleet order: every worker's, when the block is shared."""
        return self._fleet.stats.in_flight()

    def in_flight_tokens(self) -> np.ndarray | None:
        """Prompt tokens of this worker's attempts in flight per engine: on a prefill
        engine the prefill work queued or running, elsewhere the context held."""
        return np.array(self._fleet.tokens_in_flight, dtype=np.float64)


class LoadView(RequestView):
    """A :class:`RequestView` that is also the ``marginal-cost`` policy's
    :class:`~fastroute.policy.marginal.EngineStateView`, over an
    :class:`~fastroute.proxy.engine_load.EngineLoad`."""

    __slots__ = ("_load",)

    def __init__(
        self, fleet: Fleet, state: FleetState, request_mask: np.ndarray, load: EngineLoad
    ) -> None:
        super().__init__(fleet, state, request_mask)
        self._load = load

    def engine_state(self) -> EngineState:
        """Per-engine load (this worker's bookkeeping plus fresh engine scrapes)."""
        return self._load.engine_state()

    def cached_prefix_tokens(self, request: Any) -> np.ndarray | None:
        """Unknown to the proxy: the policy uses its own prefix tree."""
        return None


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
    """

    def __init__(
        self,
        fleet: Fleet,
        name: str,
        *,
        interval_s: float = 0.5,
        on_change: Callable[[FleetState], None] | None = None,
    ) -> None:
        self.fleet = fleet
        self.name = name
        self.interval_s = interval_s
        self.on_change = on_change
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
