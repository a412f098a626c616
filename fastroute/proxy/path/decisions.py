"""Decision records: why a request went where it went (docs/design.md §3 step 9).

Each routed request gets a :class:`DecisionRecord`, filled in as the request moves
along its path (class, candidates and scores, filters that removed engines and why,
weights, attempts and their outcomes, timings). The compact form travels in the
``x-fastroute-decision`` response header; the full record stays in a bounded
:class:`DecisionLog` ring buffer (oldest evicted first) and is served by
``GET /admin/decisions/{request_id}``.

Compact header grammar: ``key=value`` pairs joined by ``;``, for example
``policy=weighted-hrw;reason=hrw;rank=0;attempt=1;gen=12;key=header;class=chat``.
``rank`` is the position in the ranking of the engine that answered, ``attempt`` the
1-based attempt number, ``gen`` the weight-table generation (0 = capacity-proportional
fallback weights from the config).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec

__all__ = ["Attempt", "DecisionRecord", "DecisionLog", "DEFAULT_CAPACITY"]

#: Records kept by default (at a few hundred bytes each, about 1-2 MB).
DEFAULT_CAPACITY = 4096


@dataclass(slots=True)
class Attempt:
    """One attempt to an engine and how it ended."""

    engine: str
    rank: int
    outcome: str = "pending"
    status: int | None = None
    detail: str | None = None
    duration_s: float | None = None
    #: ``prefill`` or ``decode`` for the steps of a P/D request; None for whole requests.
    stage: str | None = None
    #: A stream's output tokens: the engine's ``usage.completion_tokens``, else the
    #: events that carried tokens.
    output_tokens: int | None = None


@dataclass(slots=True)
class DecisionRecord:
    """Everything the proxy decided for one request.

    Attributes
    ----------
    request_id : str
        The ``x-request-id`` the response carries.
    endpoint : str
        Path of the request (``/v1/chat/completions``...).
    model, priority, tenant, class_name : str
        The classification.
    zones : list of str
        Residency zones the request may be served in.
    row : int
        Class row in the weight table.
    key_source : str
        Where the routing key came from (``header``, ``conversation``...).
    generation : int
        Weight-table generation the decision used (0: config fallback weights).
    policy, reason : str
        Policy name and its decision reason.
    candidates : list of dict
        The ranking: engine name, rank, weight and policy score of each.
    filters : list of dict
        Engines excluded from the class row, each with the filter and why.
    attempts : list of Attempt
        Attempts in order.
    status : int or None
        HTTP status returned to the client.
    error : str or None
        What went wrong, if anything: a request rejected before routing (400, 401,
        403, 404, 413: no class, no candidates), a shed, a failed attempt...
    timings : dict of str to float
        Seconds from arrival: ``decided``, ``first_byte``, ``first_token``, ``done``;
        ``tbot_s`` mean time between output tokens after the first.
    prediction : dict or None
        ``marginal-cost`` classes only: the predicted TTFT/TPOT, output length, cached
        tokens, the marginal cost (seconds) of each ranked candidate, why a request was
        rejected, and the calibration sample counts per engine type and kind (per
        stage for P/D).
    bootstrap_room : int or None
        SGLang P/D requests: the ``bootstrap_room`` of the last pair attempt (both its
        engines got it).
    segments : list of dict
        A stream migrated mid-stream (docs/failure-handling.md): each segment of the
        client's one stream in order, its ``engine``, output ``tokens``, ``outcome`` and
        why it ended (``ended``: ``drain``, ``error``, ``timeout``, ``connection``; the
        last segment's is its outcome); empty for a stream that was not.
    not_migrated : str or None
        A stream that broke after bytes reached the client and was not continued, or that
        stays on its draining engine: why.
    hedge : dict or None
        A stream of a ``hedge = true`` class (docs/failure-handling.md): the hedge
        ``delay_s``, whether the hedge was ``sent``, its ``runner_up``, the ``winner``
        engine and the ``outcome`` (``won``, ``lost``, ``cancelled``), or why it was
        ``refused``; None for other requests.

    ``candidates`` and ``filters`` may be deferred (:meth:`defer`): rendering names,
    weights and filter explanations for every request cost more than the rest of the
    record, and almost no record is ever read. :meth:`DecisionLog.get` and
    :meth:`to_json` render them first.
    """

    request_id: str
    endpoint: str
    model: str = ""
    priority: str = ""
    tenant: str = ""
    class_name: str = ""
    zones: list[str] = field(default_factory=list)
    row: int = -1
    key_source: str = ""
    generation: int = 0
    policy: str = ""
    reason: str = ""
    candidates: list[dict[str, Any]] = field(default_factory=list)
    filters: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    status: int | None = None
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    prediction: dict[str, Any] | None = None
    bootstrap_room: int | None = None
    segments: list[dict[str, Any]] = field(default_factory=list)
    not_migrated: str | None = None
    hedge: dict[str, Any] | None = None
    # Renders (candidates, filters) from what the decision captured; None once rendered.
    _render: Callable[[], tuple[list[dict[str, Any]], list[dict[str, Any]]]] | None = field(
        default=None, repr=False
    )

    def defer(
        self, render: Callable[[], tuple[list[dict[str, Any]], list[dict[str, Any]]]]
    ) -> None:
        """Fill ``candidates`` and ``filters`` from ``render()`` when first needed."""
        self._render = render

    def materialize(self) -> DecisionRecord:
        """Render deferred ``candidates`` and ``filters`` (idempotent); returns self."""
        render = self._render
        if render is not None:
            self._render = None
            self.candidates, self.filters = render()
        return self

    def header(self) -> str:
        """The compact ``x-fastroute-decision`` value."""
        rank = self.attempts[-1].rank if self.attempts else -1
        return (
            f"policy={self.policy};reason={self.reason};rank={rank};"
            f"attempt={len(self.attempts)};gen={self.generation};key={self.key_source};"
            f"class={self.class_name}"
        )

    def to_json(self) -> bytes:
        """The full record as JSON."""
        self.materialize()
        return msgspec.json.encode({name: getattr(self, name) for name in _PUBLIC_FIELDS})


#: The fields of the JSON record, in declaration order (``_render`` is internal).
_PUBLIC_FIELDS = tuple(f.name for f in fields(DecisionRecord) if not f.name.startswith("_"))


class DecisionLog:
    """A bounded ring buffer of decision records, looked up by request id.

    Parameters
    ----------
    capacity : int
        Most records kept; adding one more evicts the oldest.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._records: OrderedDict[str, DecisionRecord] = OrderedDict()

    def add(self, record: DecisionRecord) -> None:
        """Keep ``record`` (it may still be updated in place until the request ends)."""
        records = self._records
        if record.request_id in records:
            records.move_to_end(record.request_id)
        records[record.request_id] = record
        if len(records) > self.capacity:
            records.popitem(last=False)

    def get(self, request_id: str) -> DecisionRecord | None:
        """The record of ``request_id`` (rendered in full), or None if unknown or evicted."""
        record = self._records.get(request_id)
        return None if record is None else record.materialize()

    def __len__(self) -> int:
        return len(self._records)
