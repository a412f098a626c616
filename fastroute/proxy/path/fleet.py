"""The proxy's view of the fleet: engines, class rows, weights, availability.

Engines are the config's ``[[engines]]``, in file order: that order is the engine
index everywhere in the proxy (selector, outlier detector, in-flight counts), so a
new weight table never re-indexes local state. Class rows are one per
(model, priority) of the config's models.

Weights come from one of two sources (docs/design.md §2):

* the shared-memory weight table ``proxy.table_name``, when it exists: each row is
  looked up by :func:`class_key` ``(proxy.cluster, model, priority)`` and its weights
  are mapped onto the config's engines by engine id (``hashing.engine_id(name)``);
  engines the table does not list get weight 0 in that row, engines the config does
  not list are ignored (the proxy has no address for them), a row the table lacks
  falls back to capacity weights; the table's engine flags and shed fractions apply;
* otherwise capacity-proportional weights: in each row, every engine serving the
  row's model (role ``both``) with weight ``capacity_rps``.

The fleet's other jobs have their own modules: live per-engine statistics
(:mod:`fastroute.proxy.path.engine_stats`), eligibility and its explanations
(:mod:`fastroute.proxy.path.eligibility`, :attr:`Fleet.eligibility`), the per-request views
policies decide over (:mod:`fastroute.proxy.path.fleet_views`) and the weight-table watcher
(:mod:`fastroute.proxy.background.table_watch`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fastroute._core import Selector
from fastroute._core.selector_py import ZERO_WEIGHT_RATIO
from fastroute.config import PRIORITIES, Config, EngineConfig
from fastroute.hashing import class_key, engine_id
from fastroute.policy.base import prefill_cost_from_capacity
from fastroute.proxy.path.concurrency import ConcurrencyCaps
from fastroute.proxy.path.drain import DrainMarks
from fastroute.proxy.path.eligibility import Eligibility
from fastroute.proxy.path.engine_stats import CountingOutlierDetector, EngineStats, InFlightCounts
from fastroute.proxy.path.fleet_views import LoadView, RequestView
from fastroute.tables import TableSnapshot
from fastroute.tables.stats import Ewma, StatsBlock

__all__ = ["class_key", "FleetState", "Fleet", "QueuedPrefill"]

if TYPE_CHECKING:
    from fastroute.proxy.path.engine_load import EngineLoad

logger = logging.getLogger(__name__)


class QueuedPrefill:
    """An attempt's prompt tokens, counted as queued on its engine
    (``Counter.QUEUED_TOKENS``) from its forward until its first streamed token, the end
    of its JSON answer, or its failure, whichever comes first (:meth:`done`, idempotent).
    """

    __slots__ = ("_stats", "_index", "tokens")

    def __init__(self, stats: EngineStats, index: int, tokens: int) -> None:
        self._stats = stats
        self._index = index
        self.tokens = int(tokens)
        if self.tokens:
            stats.add_queued(index, self.tokens)

    def done(self) -> None:
        """The engine prefilled the prompt (or gave up on it): no longer queued."""
        if self.tokens:
            self._stats.add_queued(self._index, -self.tokens)
            self.tokens = 0


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
    tenant_meta : dict
        The table meta's ``tenant_limits`` and ``tenant_shed`` entries (the controller's
        per-proxy tenant shares and per-tenant shed fractions); empty for the fallback.
    """

    generation: int
    published_at: float | None
    weights: np.ndarray
    positive: np.ndarray
    available: np.ndarray
    shed_fraction: np.ndarray
    retry_ratio: float | None
    selector: Any
    tenant_meta: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        """``"table"`` or ``"config"``."""
        return "config" if self.generation == 0 else "table"


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
        self._warned_no_rows = False
        self.row_keys = np.array(
            [class_key(config.proxy.cluster, m, p) for (m, p) in self.rows], dtype=np.uint64
        )
        self._serves = np.zeros((len(self.rows), len(self.engines)), dtype=bool)
        self._fallback = np.zeros(self._serves.shape, dtype=np.float64)
        for (model, _), row in self.rows.items():
            for i, e in enumerate(self.engines):
                if model in e.models and e.role == "both":
                    self._serves[row, i] = True
                    self._fallback[row, i] = e.capacity_rps
        self.stats = EngineStats(self.engine_ids, stats_block)
        #: Each engine's time per prefilled token relative to the fastest's, from the
        #: configured capacities (``prefill_cost_from_capacity``); None when they are equal.
        self.prefill_cost = prefill_cost_from_capacity([e.capacity_rps for e in self.engines])
        ej = config.ejection
        self.outlier: CountingOutlierDetector = CountingOutlierDetector(
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
        #: Which engines may serve a request
        #: (:class:`~fastroute.proxy.path.eligibility.Eligibility`).
        self.eligibility = Eligibility(self.engines, self._serves, self.outlier, self.caps, clock)
        #: Per-engine load for the ``marginal-cost`` policy
        #: (:class:`~fastroute.proxy.path.engine_load.EngineLoad`); None unless a class uses it.
        self.load: EngineLoad | None = None
        #: When streams on each engine hand off because it is draining
        #: (:class:`~fastroute.proxy.path.drain.DrainMarks`).
        self.drain = DrainMarks(len(self.engines), config.retry.drain_handoff_after_s)
        self.state = self._make_state(0, None, self._fallback.copy(), None, None, None)

    @property
    def n_engines(self) -> int:
        """Number of engines."""
        return len(self.engines)

    def attempt_started(self, index: int, tokens: int = 0, queued_tokens: int = 0) -> QueuedPrefill:
        """An attempt of ``tokens`` (prompt + output budget) was sent to engine ``index``:
        in-flight + 1, in-flight tokens + ``tokens``, queued tokens + ``queued_tokens``
        (its prompt, unless it is a P/D decode step) until the returned handle's
        :meth:`~QueuedPrefill.done` (host-wide when the block is shared)."""
        self.stats.add_in_flight(index, 1, tokens)
        self.caps.started(index)
        return QueuedPrefill(self.stats, index, queued_tokens)

    def attempt_finished(self, index: int, tokens: int = 0) -> None:
        """An attempt to engine ``index`` ended (any way): in-flight - 1; pass the
        ``tokens`` it started with."""
        self.stats.add_in_flight(index, -1, -tokens)
        self.caps.finished(index)

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
        tenant_meta: dict[str, Any] | None = None,
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
            tenant_meta=tenant_meta or {},
        )

    def state_from_snapshot(self, snap: TableSnapshot) -> FleetState:
        """Map a weight-table snapshot onto the config's engines and rows."""
        weights = self._fallback.copy()
        shed = np.zeros(len(self.rows))
        cols = [(n, self._index_of_id.get(int(i))) for n, i in enumerate(snap.engine_ids)]
        cols = [(t, c) for t, c in cols if c is not None]
        table_cols = np.array([t for t, _ in cols], dtype=np.intp)
        our_cols = np.array([c for _, c in cols], dtype=np.intp)
        matched = 0
        for row, key in enumerate(self.row_keys):
            try:
                trow = snap.row(int(key))
            except KeyError:
                continue  # the controller has no row for this class: capacity weights
            matched += 1
            weights[row, :] = 0.0
            weights[row, our_cols] = snap.weights[trow, table_cols]
            shed[row] = float(snap.shed_fraction[trow])
        weights[~self._serves] = 0.0  # never route a model to an engine not serving it
        self._say_if_no_rows(snap, matched)
        available = np.ones(self.n_engines, dtype=bool)
        available[our_cols] = snap.available().astype(bool)[table_cols]
        return self._make_state(
            snap.generation,
            snap.published_at,
            weights,
            available,
            shed,
            float(snap.retry_ratio),
            _tenant_meta(snap),
        )

    def _say_if_no_rows(self, snap: TableSnapshot, matched: int) -> None:
        """Warn once when a table with rows has none of this proxy's cluster (e.g. a table
        another region's proxy on this host pulled under the same ``proxy.table_name``):
        the proxy then routes on capacity weights."""
        missing = matched == 0 and len(snap.class_keys) > 0
        if missing and not self._warned_no_rows:
            logger.warning(
                "weight table generation %d has %d rows but none for cluster %r: routing on "
                "capacity weights (a table of another region under this proxy.table_name?)",
                snap.generation, len(snap.class_keys), self.config.proxy.cluster,
            )  # fmt: skip
        self._warned_no_rows = missing

    def apply_snapshot(self, snap: TableSnapshot) -> FleetState:
        """Adopt a new table generation (engines it flags draining or unavailable start
        draining for the relays, :attr:`drain`); returns the new state."""
        self.state = self.state_from_snapshot(snap)
        self.drain.follow(self.state.available)
        return self.state

    def leaving(self, in_force: Collection[str]) -> list[str]:
        """The config now in force (a reload) names only ``in_force``: this fleet's other
        engines drain for the streams still relaying from them; their names."""
        gone = [i for i, name in enumerate(self.names) if name not in in_force]
        self.drain.gone(gone)
        return [self.names[i] for i in gone]

    # -- per-request views ------------------------------------------------------------------

    def view(self, request_mask: np.ndarray) -> RequestView:
        """A :class:`~fastroute.policy.FleetView` for one request."""
        return RequestView(self, self.state, request_mask)

    def load_view(self, request_mask: np.ndarray) -> LoadView:
        """A view that is also an ``EngineStateView`` (needs :attr:`load`)."""
        assert self.load is not None
        return LoadView(self, self.state, request_mask, self.load)


def _tenant_meta(snap: TableSnapshot) -> dict[str, Any]:
    """The tenant entries of a snapshot's meta (decoded once per table generation)."""
    try:
        meta = snap.meta
    except ValueError:  # an undecodable meta (msgspec.DecodeError) must not stop routing
        return {}
    return {k: meta[k] for k in ("tenant_limits", "tenant_shed") if k in meta}
