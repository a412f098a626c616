"""The data plane's report to the controller, and the aggregator that fills it (docs/design.md §4).

Every ``proxy.report_interval_s`` each worker drains its :class:`DemandAggregator`
into one :class:`Report` and posts :func:`encode_report` (msgpack) to the
controller. A report covers one window ``[window_start_s, window_end_s)`` (Unix
seconds) and holds:

* per class key (``fastroute.proxy.path.fleet.class_key(cluster, model, priority)``):
  requests, estimated prompt tokens, output tokens, sheds (refused by the proxy:
  the controller's shed fraction or admission), and 429s sent to clients;
* per engine id (``fastroute.hashing.engine_id(name)``): attempts, failures by
  kind, in-band TTFT and TBOT summaries (:class:`LatencySummary`, mergeable log
  buckets), the local ejection flag and the in-flight count at drain time;
* optionally the worker's step-time calibration
  (:class:`~fastroute.predict.CalibrationSnapshot`), when it folded in new observations
  since its last report (``marginal-cost`` classes only): the controller publishes the
  fleet's best state per engine type to new workers.

All structs are ``array_like`` (positional msgpack arrays, no field names on the
wire). The first element of a report is :data:`REPORT_VERSION`; a decoder refuses
other versions with :class:`ReportVersionError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import msgspec

from fastroute.errors import FastrouteError
from fastroute.predict.calibration import CalibrationSnapshot
from fastroute.signals.histogram import LogHistogram

__all__ = [
    "CalibrationSnapshot",  # fastroute.predict's, re-exported: a report's payload type
    "REPORT_VERSION",
    "ReportError",
    "ReportVersionError",
    "LatencySummary",
    "ClassDemand",
    "EngineReport",
    "TenantDemand",
    "Report",
    "encode_report",
    "decode_report",
    "DemandAggregator",
    "completion_tokens_of",
]

#: Version of the report wire format (first element of every report).
REPORT_VERSION = 1
#: Distinct failure kinds kept per engine and window (more are counted as "other").
MAX_FAILURE_KINDS = 16


class ReportError(FastrouteError, ValueError):
    """A report payload cannot be decoded."""


class ReportVersionError(ReportError):
    """A report has a version this code does not read."""


class LatencySummary(msgspec.Struct, array_like=True, frozen=True):
    """A window's latencies on one engine.

    Attributes
    ----------
    count : int
    sum_s, max_s : float
    p50_s, p90_s, p99_s : float
        Approximate quantiles (±9 %, see :mod:`fastroute.signals.histogram`).
    buckets : list of (int, int)
        Sparse ``(log bucket index, count)``: add them to merge workers exactly.
    """

    count: int
    sum_s: float
    max_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    buckets: list[tuple[int, int]]

    @classmethod
    def of(cls, hist: LogHistogram) -> LatencySummary | None:
        """Summary of ``hist``; None when it is empty."""
        if hist.count == 0:
            return None
        return cls(
            count=hist.count,
            sum_s=hist.sum,
            max_s=hist.max,
            p50_s=hist.quantile(0.5) or 0.0,
            p90_s=hist.quantile(0.9) or 0.0,
            p99_s=hist.quantile(0.99) or 0.0,
            buckets=hist.sparse(),
        )

    @property
    def mean_s(self) -> float:
        """Mean latency, seconds."""
        return self.sum_s / self.count if self.count else 0.0


class ClassDemand(msgspec.Struct, array_like=True):
    """Demand of one class in one window.

    Attributes
    ----------
    class_key : int
        The class row key (u64).
    requests : int
        Classified requests, shed ones included.
    prompt_tokens : int
        Estimated prompt tokens of those requests (no tokenizer: ±30 %).
    output_tokens : int
        Output tokens seen: ``usage.completion_tokens`` of JSON responses, streamed
        chunks for SSE responses (approximate).
    sheds : int
        Requests the proxy refused with 429 (shed fraction or admission).
    rejected_429 : int
        Engine 429s relayed to clients.
    """

    class_key: int
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    sheds: int = 0
    rejected_429: int = 0


class TenantDemand(msgspec.Struct, array_like=True):
    """Demand of one tenant at one priority in one window (for the fleet-wide limits).

    Attributes
    ----------
    tenant : str
    priority : str
    requests : int
        Requests offered (refused ones included: the split follows demand, not what
        the last split let through).
    tokens : int
        Their estimated prompt + ``max_tokens`` tokens.
    """

    tenant: str
    priority: str
    requests: int = 0
    tokens: int = 0


class EngineReport(msgspec.Struct, array_like=True):
    """One engine in one window, as this worker saw it.

    Attributes
    ----------
    engine_id : int
        Stable engine id (u64).
    attempts : int
        Upstream attempts that ended (success or failure).
    failures : dict of str to int
        Failed attempts by kind (``http_5xx``, ``connect_error``, ``timeout``,
        ``rate_limited``, ``client_error``).
    ttft, tbot : LatencySummary or None
        In-band time to first token and time between output chunks (streams only).
    ejected : bool
        Locally ejected by the outlier detector at drain time.
    in_flight : int
        Requests in flight to it from this worker at drain time.
    """

    engine_id: int
    attempts: int = 0
    failures: dict[str, int] = {}
    ttft: LatencySummary | None = None
    tbot: LatencySummary | None = None
    ejected: bool = False
    in_flight: int = 0


class Report(msgspec.Struct, array_like=True):
    """One window of one data-plane worker.

    Attributes
    ----------
    version : int
        :data:`REPORT_VERSION`.
    source_cluster : str
        ``proxy.cluster`` of the reporting proxy.
    worker_id : str
        Unique per worker process (host and pid by default).
    window_start_s, window_end_s : float
        Unix seconds.
    classes : list of ClassDemand
    engines : list of EngineReport
    dropped : int
        Observations dropped because a bound (classes, engines) was reached.
    calibration : CalibrationSnapshot or None
        The worker's calibration, when it changed since its last report. Appended
        last: decoders that predate it ignore it, and reports without it still decode.
    proxy_id : str
        The reporting proxy (host and port), the key of its tenant shares; appended
        after ``calibration`` for the same reason.
    tenants : list of TenantDemand
        Per-tenant demand of the window (tenants with limits or weights only).
    """

    version: int
    source_cluster: str
    worker_id: str
    window_start_s: float
    window_end_s: float
    classes: list[ClassDemand]
    engines: list[EngineReport]
    dropped: int = 0
    calibration: CalibrationSnapshot | None = None
    proxy_id: str = ""
    tenants: list[TenantDemand] = []

    @property
    def window_s(self) -> float:
        """Window length, seconds."""
        return self.window_end_s - self.window_start_s


class _Head(msgspec.Struct, array_like=True):
    version: int


_encoder = msgspec.msgpack.Encoder()
_head_decoder = msgspec.msgpack.Decoder(_Head)
_report_decoder = msgspec.msgpack.Decoder(Report)


def encode_report(report: Report) -> bytes:
    """msgpack bytes of ``report``."""
    return _encoder.encode(report)


def decode_report(data: bytes) -> Report:
    """Decode and validate a report.

    Raises
    ------
    ReportVersionError
        The version is not :data:`REPORT_VERSION`.
    ReportError
        The payload is not a well-formed report.
    """
    try:
        head = _head_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ReportError(f"not a fastroute report: {exc}") from None
    if head.version != REPORT_VERSION:
        raise ReportVersionError(
            f"report version {head.version}; this code reads version {REPORT_VERSION}"
        )
    try:
        report = _report_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ReportError(f"malformed report: {exc}") from None
    if report.window_end_s < report.window_start_s:
        raise ReportError(
            f"window ends ({report.window_end_s}) before it starts ({report.window_start_s})"
        )
    return report


def completion_tokens_of(body: bytes) -> int:
    """``usage.completion_tokens`` of an OpenAI JSON response, found without parsing it
    (``usage.output_tokens`` of a Responses or Anthropic Messages answer).

    Returns 0 when the body does not carry it.
    """
    i = body.rfind(b'"completion_tokens"')
    if i < 0:
        i = body.rfind(b'"output_tokens"')
    if i < 0:
        return 0
    j = body.find(b":", i) + 1
    if j <= 0:
        return 0
    end = j
    n = len(body)
    while end < n and body[end] in b" \t\r\n":
        end += 1
    start = end
    while end < n and 48 <= body[end] <= 57:
        end += 1
    return int(body[start:end]) if end > start else 0


class _EngineAcc:
    __slots__ = ("attempts", "failures", "ttft", "tbot")

    def __init__(self) -> None:
        self.attempts = 0
        self.failures: dict[str, int] = {}
        self.ttft = LogHistogram()
        self.tbot = LogHistogram()


class DemandAggregator:
    """Per-window counters of one worker; O(1) per observation, bounded memory.

    Parameters
    ----------
    source_cluster : str
        Copied into every report.
    worker_id : str
        Copied into every report.
    max_classes, max_engines : int
        Distinct class keys / engine ids kept per window; observations of others
        are counted in ``Report.dropped``.
    clock : callable
        Unix seconds (default ``time.time``); the first window starts at creation.

    Notes
    -----
    Single-threaded (the event loop); no locks.
    """

    def __init__(
        self,
        source_cluster: str,
        worker_id: str,
        *,
        max_classes: int = 4096,
        max_engines: int = 8192,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source_cluster = source_cluster
        self.worker_id = worker_id
        self.max_classes = max_classes
        self.max_engines = max_engines
        self.clock = clock
        self._start_s = clock()
        self._classes: dict[int, ClassDemand] = {}
        self._engines: dict[int, _EngineAcc] = {}
        self._dropped = 0
        #: The proxy's key for its tenant shares (set by the proxy app).
        self.proxy_id = ""
        # Bounded by max_classes too: tenants x priorities is config-sized.
        self._tenants: dict[tuple[str, str], TenantDemand] = {}

    def observe_tenant(self, tenant: str, priority: str, tokens: int) -> None:
        """Count one request offered by ``tenant`` at ``priority`` (``tokens`` estimated)."""
        d = self._tenants.get((tenant, priority))
        if d is None:
            if len(self._tenants) >= self.max_classes:
                self._dropped += 1
                return
            d = self._tenants[(tenant, priority)] = TenantDemand(tenant, priority)
        d.requests += 1
        d.tokens += tokens

    def _class(self, class_key: int) -> ClassDemand | None:
        c = self._classes.get(class_key)
        if c is None:
            if len(self._classes) >= self.max_classes:
                self._dropped += 1
                return None
            c = self._classes[class_key] = ClassDemand(class_key)
        return c

    def _engine(self, engine_id: int) -> _EngineAcc | None:
        e = self._engines.get(engine_id)
        if e is None:
            if len(self._engines) >= self.max_engines:
                self._dropped += 1
                return None
            e = self._engines[engine_id] = _EngineAcc()
        return e

    def observe_request(
        self,
        class_key: int,
        prompt_tokens: int = 0,
        output_tokens: int = 0,
        *,
        shed: bool = False,
        status: int | None = None,
    ) -> None:
        """Count one classified request of ``class_key``.

        Parameters
        ----------
        class_key : int
        prompt_tokens, output_tokens : int
            Token counts known now (output tokens may also come later through
            :meth:`observe_output`).
        shed : bool
            The proxy refused it with 429 (shed fraction or admission).
        status : int, optional
            Client-facing status if known; 429 counts in ``rejected_429`` unless shed.
        """
        c = self._class(class_key)
        if c is None:
            return
        c.requests += 1
        c.prompt_tokens += prompt_tokens
        c.output_tokens += output_tokens
        if shed:
            c.sheds += 1
        elif status == 429:
            c.rejected_429 += 1

    def observe_output(self, class_key: int, output_tokens: int) -> None:
        """Add output tokens of a request of ``class_key`` already counted."""
        c = self._class(class_key)
        if c is not None:
            c.output_tokens += output_tokens

    def observe_rejected(self, class_key: int) -> None:
        """Count an engine 429 relayed to the client of a request already counted."""
        c = self._class(class_key)
        if c is not None:
            c.rejected_429 += 1

    def observe_attempt(self, engine_id: int, ok: bool, kind: str | None = None) -> None:
        """Count one ended attempt on ``engine_id``; a failure is counted under ``kind``."""
        e = self._engine(engine_id)
        if e is None:
            return
        e.attempts += 1
        if not ok:
            kind = kind or "other"
            failures = e.failures
            if kind not in failures and len(failures) >= MAX_FAILURE_KINDS:
                kind = "other"
            failures[kind] = failures.get(kind, 0) + 1

    def observe_latency(
        self, engine_id: int, ttft_s: float | None = None, tbot_s: float | None = None
    ) -> None:
        """Record an in-band TTFT and/or TBOT (seconds) measured on ``engine_id``."""
        e = self._engine(engine_id)
        if e is None:
            return
        if ttft_s is not None:
            e.ttft.observe(ttft_s)
        if tbot_s is not None:
            e.tbot.observe(tbot_s)

    def drain(
        self,
        now_s: float | None = None,
        *,
        in_flight: Mapping[int, int] | None = None,
        ejected: Mapping[int, bool] | None = None,
    ) -> Report:
        """Close the window at ``now_s``, return its report and start the next one.

        Parameters
        ----------
        now_s : float, optional
            Unix seconds; default the clock.
        in_flight, ejected : mapping of engine id, optional
            Current state per engine; every engine listed appears in the report.
        """
        end_s = self.clock() if now_s is None else now_s
        engines: list[EngineReport] = []
        ids = set(self._engines)
        if in_flight:
            ids.update(in_flight)
        if ejected:
            ids.update(ejected)
        for eid in sorted(ids):
            acc = self._engines.get(eid)
            rep = EngineReport(
                engine_id=eid,
                ejected=bool(ejected.get(eid, False)) if ejected else False,
                in_flight=int(in_flight.get(eid, 0)) if in_flight else 0,
            )
            if acc is not None:
                rep.attempts = acc.attempts
                rep.failures = acc.failures
                rep.ttft = LatencySummary.of(acc.ttft)
                rep.tbot = LatencySummary.of(acc.tbot)
            engines.append(rep)
        report = Report(
            version=REPORT_VERSION,
            source_cluster=self.source_cluster,
            worker_id=self.worker_id,
            window_start_s=self._start_s,
            window_end_s=max(end_s, self._start_s),
            classes=[self._classes[k] for k in sorted(self._classes)],
            engines=engines,
            dropped=self._dropped,
            proxy_id=self.proxy_id,
            tenants=[self._tenants[k] for k in sorted(self._tenants)],
        )
        self._tenants = {}
        self._start_s = report.window_end_s
        self._classes = {}
        self._engines = {}
        self._dropped = 0
        return report
