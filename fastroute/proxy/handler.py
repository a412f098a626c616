"""The inference request path (DESIGN.md §3), one request at a time.

``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` run, in
order: body limit (413) → minimal parse (400) → classify (tenant by API key, residency
zones, priority, model → class row; unknown model 404) → sticky shed (429) →
admission guard (429) → routing key → pick (the class's policy over a per-request
:class:`~fastroute.proxy.fleet.RequestView`, top-k ranking) → forward the original
body bytes → relay the response (SSE chunk by chunk) → record.

Failures: an attempt that fails before any byte reached the client (connect error,
timeout, a status in ``retry.retry_on_status``) is retried once on the next ranked
engine if ``retry.max_retries`` and the retry budget allow; otherwise the client gets
502 (connect error, disconnect, 5xx), 504 (timeout) or the engine's 4xx/429 in
OpenAI shape. A stream that breaks after its first byte ends with one SSE error event
and a clean end of the body. Every outcome is recorded in the outlier detector.
A client that goes away cancels the handler (the lean server, or aiohttp's
``handler_cancellation``); the upstream response is closed on the way out.

Classes whose policy is ``marginal-cost`` also read the SLO headers
(:mod:`fastroute.proxy.slo`; 400 if malformed), decide over a view with engine state
(:mod:`fastroute.proxy.engine_load`), get an early 429 ``slo_infeasible`` when no engine
is predicted to meet the SLO (once calibrated), and feed each attempt's timings into the
calibration; no other policy's path does any of this.

The path is independent of the HTTP server in front of it: :meth:`InferenceHandler.handle`
takes anything with ``path`` and ``headers`` (a case-insensitive mapping), the body
already read (None when it was over the limit) and a :class:`~fastroute.proxy.reply.Sink`
for streams, and returns a :class:`~fastroute.proxy.reply.Reply`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import msgspec
from aiohttp import web

from fastroute.config import PRIORITIES, ClassConfig, Config, TenantConfig, hash_api_key
from fastroute.guards.admission import should_shed
from fastroute.guards.outlier import Outcome
from fastroute.guards.retry_budget import RetryBudget
from fastroute.policy import Decision, Policy, RouteRequest, make_policy
from fastroute.policy.marginal import (
    REASON_SLO_INFEASIBLE,
    MarginalCost,
    MarginalDecision,
    MarginalRequest,
)
from fastroute.proxy.admission import AdmissionQueue, AdmissionRejected
from fastroute.proxy.decisions import Attempt, DecisionLog, DecisionRecord
from fastroute.proxy.engine_load import MIN_SAMPLES_TO_REJECT, AttemptLoad, EngineLoad
from fastroute.proxy.fleet import Fleet, FleetState
from fastroute.proxy.http1 import Response
from fastroute.proxy.metrics import ProxyMetrics
from fastroute.proxy.openai_errors import error_reply, sse_error_event
from fastroute.proxy.pd import PDPools, PDProtocolError, decode_body, prefill_body, transfer_params
from fastroute.proxy.reply import Reply, Sink, Splice
from fastroute.proxy.requests import (
    ChatRequest,
    CompletionRequest,
    ParsedRequest,
    RequestParseError,
    parse_chat,
    parse_completion,
)
from fastroute.proxy.routing_key import estimate_prompt_tokens, routing_key
from fastroute.proxy.slo import request_slos
from fastroute.proxy.sse import DATA_PREFIX, USAGE_MARK, output_events
from fastroute.proxy.upstream import HOP_BY_HOP, UpstreamError, UpstreamPool
from fastroute.signals.reports import DemandAggregator, completion_tokens_of
from fastroute.tables.stats import Ewma

__all__ = [
    "ProxyContext",
    "InferenceHandler",
    "build_policies",
    "PREFIX_BYTES",
    "assign_request_id",
    "request_id_of",
    "new_request_id",
    "Incoming",
]

#: Bytes of prompt text handed to prefix-aware policies (``RouteRequest.prefix``).
PREFIX_BYTES = 4096
_REQUEST_ID = web.RequestKey("fastroute_request_id", str)
_DROP_REQUEST_HEADERS = HOP_BY_HOP | {"host", "content-length", "authorization", "accept-encoding"}
_DROP_RESPONSE_HEADERS = HOP_BY_HOP | {
    "content-length",
    "content-encoding",
    "server",
    "date",
}
_SSE_END = b"\n\n"


#: Most header names whose forward/drop verdict is cached (per handler, per direction).
MAX_CACHED_HEADER_NAMES = 1024
#: ``Attempt.outcome`` of each outcome (``Enum.name`` is a slow descriptor).
_OUTCOME_TEXT = {o: o.name.lower() for o in Outcome}
_FAILURE_OUTCOMES = frozenset({Outcome.HTTP_5XX, Outcome.CONNECT_ERROR, Outcome.TIMEOUT})


def _forwardable(low: str, drop: frozenset[str]) -> bool:
    """Whether a header (lowercase name) passes a drop set and the proxy's own names."""
    return not (low in drop or low.startswith("x-fastroute-") or low == "x-request-id")


def _header_lines(
    raw: Iterable[tuple[bytes, bytes]], drop: frozenset[str], verdicts: dict[bytes, bool]
) -> list[bytes]:
    """The encoded ``name: value\\r\\n`` lines of the raw pairs that pass ``drop``.

    Headers are relayed as the parser gave them (no CR/LF inside), never decoded.
    ``verdicts`` caches the decision per raw name: clients and engines send the same
    few header names over and over.
    """
    lines = []
    for name, value in raw:
        keep = verdicts.get(name)
        if keep is None:
            keep = _forwardable(name.decode("latin-1").lower(), drop)
            if len(verdicts) >= MAX_CACHED_HEADER_NAMES:
                verdicts.clear()
            verdicts[name] = keep
        if keep:
            lines.append(b"%b: %b\r\n" % (name, value))
    return lines


class _EmbeddingRequest(msgspec.Struct):
    """The fields of ``POST /v1/embeddings`` routing reads."""

    model: str | None = None
    user: str | None = None


_embedding_decoder = msgspec.json.Decoder(_EmbeddingRequest)


def _parse_embeddings(body: bytes) -> CompletionRequest:
    try:
        req = _embedding_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise RequestParseError(f"Invalid request body: {exc}", None) from None
    # An empty prompt makes routing_key fall through to user, then the request id:
    # embeddings have no KV cache to be sticky to.
    return CompletionRequest(model=req.model, user=req.user, prompt="")


def build_policies(config: Config) -> dict[str, Policy]:
    """One policy instance per policy name the config uses.

    Raises
    ------
    fastroute.policy.PolicyConfigError
        A policy is not implemented or its parameters are invalid.
    """
    names = {config.policy.default} | {c.policy for c in config.classes if c.policy}
    policies: dict[str, Policy] = {}
    for name in sorted(names):
        params: dict[str, Any] = dict(config.policy.params.get(name, {}))
        if name == "weighted-hrw" and config.policy.bounded_load:
            params.setdefault("balance_factor", config.policy.bounded_load_factor)
        policies[name] = make_policy(name, **params)
    return policies


@dataclass(slots=True)
class _Classified:
    model: str
    priority: str
    tenant: str
    zones: frozenset[str]
    hardware: str | None
    cls: ClassConfig
    row: int
    #: The request's SLOs (headers or class defaults); set for ``marginal-cost`` classes.
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None


class _Reject(Exception):
    """A request refused before routing; carries the response."""

    def __init__(self, response: Reply) -> None:
        super().__init__(response.status)
        self.response = response

    @property
    def reason(self) -> str:
        """Why, for the decision record: the error message the client got."""
        try:
            message = msgspec.json.decode(self.response.body)["error"]["message"]
        except (msgspec.DecodeError, KeyError, TypeError):
            message = None
        return f"rejected before routing (HTTP {self.response.status}): {message}"


class Incoming(Protocol):
    """What the request path reads of a request (aiohttp's ``web.Request`` is one)."""

    @property
    def path(self) -> str:
        """The request path (one of the three inference endpoints)."""

    @property
    def headers(self) -> Mapping[str, str]:
        """Request headers, case-insensitive (``CIMultiDict``/``CIMultiDictProxy``)."""

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        """The same headers as received: (name, value) bytes, in order."""


@dataclass(slots=True)
class ProxyContext:
    """Everything the request path shares, built once per app.

    Attributes
    ----------
    config : Config
    fleet : Fleet
    policies : dict of str to Policy
    budget : RetryBudget
    admission : AdmissionQueue or None
        None when ``admission.enabled`` is false.
    decisions : DecisionLog
    metrics : ProxyMetrics
    upstream : UpstreamPool or None
        Created on startup (it needs the running loop).
    pd : PDPools or None
        The prefill and decode pools, when the config has P/D engines.
    aggregator : DemandAggregator or None
        Per-window report counters, set by ``install_signal_tasks`` when a
        controller is configured; None: nothing is counted.
    scraper : EngineScraper or None
        The proxy's own engine scraper (``proxy.scrape_engines``), set by
        ``install_signal_tasks``; the ``marginal-cost`` engine load merges its scrapes.
    """

    config: Config
    fleet: Fleet
    policies: dict[str, Policy]
    budget: RetryBudget
    admission: AdmissionQueue | None
    decisions: DecisionLog
    metrics: ProxyMetrics
    upstream: UpstreamPool | None = None
    pd: PDPools | None = None
    aggregator: DemandAggregator | None = None
    scraper: Any = None
    ready: bool = False
    draining: bool = False


def _new_id_prefix() -> str:
    # 64 random bits per process: ids stay unique across workers and restarts.
    return f"req-{secrets.token_hex(8)}-"


# A per-process random prefix plus a counter: uuid4 per request was ~2 % of a worker's
# CPU. A forked child draws a new prefix (workers are exec'ed anyway).
_id_prefix = _new_id_prefix()
_id_counter = itertools.count(1)


def _reset_ids_after_fork() -> None:
    global _id_prefix, _id_counter
    _id_prefix = _new_id_prefix()
    _id_counter = itertools.count(1)


os.register_at_fork(after_in_child=_reset_ids_after_fork)


def new_request_id() -> str:
    """A fresh, unique request id (client-supplied ids are not trusted)."""
    return f"{_id_prefix}{next(_id_counter):x}"


def request_id_of(request: Incoming) -> str:
    """The request's id, assigned on first use."""
    # Not ``request.get``: the generic ``Mapping.get`` of aiohttp's request costs more.
    try:
        return request[_REQUEST_ID]
    except KeyError:
        rid = request[_REQUEST_ID] = new_request_id()
        return rid


def assign_request_id(request: Incoming) -> str:
    """Give a new request its id (the middleware does, before any handler)."""
    rid = request[_REQUEST_ID] = new_request_id()
    return rid


class InferenceHandler:
    """The handlers of the three inference endpoints over one :class:`ProxyContext`."""

    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx
        config = ctx.config
        self.config = config
        self._tenant_by_hash: dict[str, TenantConfig] = {}
        for tenant in config.tenants:
            for key in tenant.api_keys:
                self._tenant_by_hash[hash_api_key(key)] = tenant
            for digest in tenant.api_key_sha256:
                self._tenant_by_hash[digest] = tenant
        self._default_tenant = next(
            (t for t in config.tenants if t.name == config.proxy.default_tenant), None
        )
        self._all_zones = frozenset(r.zone for r in config.network.regions) | frozenset(
            e.zone for e in config.engines if e.zone
        )
        self._models = frozenset(config.models())
        self._sorted_zones: dict[frozenset[str], list[str]] = {}
        self._request_verdicts: dict[bytes, bool] = {}
        self._auth_lines: dict[str, bytes] = {}  # one per configured engine key
        self._budget_state: FleetState | None = None  # the state the budget's ratio is from
        self._response_verdicts: dict[bytes, bool] = {}
        #: Names of the policies that are ``marginal-cost`` (SLOs, engine load, calibration).
        self._marginal = frozenset(
            name for name, p in ctx.policies.items() if isinstance(p, MarginalCost)
        )
        self._loop: asyncio.AbstractEventLoop | None = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this handler serves in, looked up once.

        On Python 3.11 every ``asyncio.get_running_loop()`` makes a ``getpid()``
        syscall (a fork check); the request path needed about five per request, 5–8 %
        of a worker's CPU. A handler serves in one loop (its context's upstream
        connections belong to that loop).
        """
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    # -- steps -------------------------------------------------------------------------------

    def _too_large(self) -> _Reject:
        limit = self.config.limits.max_body_bytes
        return _Reject(
            error_reply(
                413,
                f"Request body is larger than the limit of {limit} bytes.",
                code="request_too_large",
            )
        )

    def _parse(self, kind: str, body: bytes) -> ParsedRequest:
        try:
            if kind == "chat":
                parsed: ParsedRequest = parse_chat(body)
            elif kind == "completions":
                parsed = parse_completion(body)
            else:
                parsed = _parse_embeddings(body)
        except RequestParseError as exc:
            err = exc.to_openai_error()["error"]
            raise _Reject(
                error_reply(400, str(err["message"]), param=err["param"], code=None)
            ) from None
        if not parsed.model:
            raise _Reject(
                error_reply(
                    400,
                    "You must provide a model parameter.",
                    param="model",
                    code="missing_model",
                )
            )
        return parsed

    def _tenant(self, request: Incoming) -> TenantConfig | None:
        if not self.config.tenants:
            return None
        auth = request.headers.get("Authorization", "")
        tenant = None
        if auth[:7].lower() == "bearer ":
            key = auth[7:].strip()
            if key:
                tenant = self._tenant_by_hash.get(hash_api_key(key))
        if tenant is None:
            tenant = self._default_tenant
        if tenant is None:
            raise _Reject(error_reply(401, "Invalid or missing API key.", code="invalid_api_key"))
        return tenant

    def _classify(self, request: Incoming, parsed: ParsedRequest) -> _Classified:
        proxy = self.config.proxy
        tenant = self._tenant(request)
        zones = frozenset(tenant.zones) if tenant and tenant.zones else self._all_zones
        narrow = request.headers.get(proxy.zone_header)
        if narrow is not None:
            asked = frozenset(z.strip() for z in narrow.split(",") if z.strip())
            zones = zones & asked
            if not zones:
                raise _Reject(
                    error_reply(
                        403,
                        f"Header {proxy.zone_header} names no residency zone this tenant "
                        f"may use (asked {sorted(asked)}).",
                        code="zone_not_allowed",
                    )
                )
        priority = request.headers.get(proxy.priority_header)
        if priority is None:
            priority = tenant.default_priority if tenant else "default"
        elif priority not in PRIORITIES:
            raise _Reject(
                error_reply(
                    400,
                    f"Header {proxy.priority_header} must be one of {', '.join(PRIORITIES)}; "
                    f"got {priority!r}.",
                    code="invalid_priority",
                )
            )
        model = str(parsed.model)
        if model not in self._models:
            raise _Reject(
                error_reply(
                    404,
                    f"The model `{model}` does not exist or is not served by this proxy.",
                    param="model",
                    code="model_not_found",
                )
            )
        return _Classified(
            model=model,
            priority=priority,
            tenant=tenant.name if tenant else "",
            zones=zones,
            hardware=tenant.hardware if tenant else None,
            cls=self.config.class_for(model, priority),
            row=self.ctx.fleet.rows[(model, priority)],
        )

    def _slos(self, request: Incoming, cls: _Classified) -> None:
        """Fill ``cls``'s SLOs from the request headers or the class defaults (400 if bad)."""
        try:
            cls.slo_ttft_s, cls.slo_tpot_s = request_slos(
                request.headers, cls.cls.ttft_slo_s, cls.cls.tbot_slo_s
            )
        except ValueError as exc:
            raise _Reject(error_reply(400, str(exc), code="invalid_slo")) from None

    def _forward_headers(self, request: Incoming, engine_key: str | None, rid: str) -> bytes:
        """The header lines to send to the engine, encoded (``http1`` takes them as is).

        Relayed as received, minus the drop set (:func:`_header_lines`).
        """
        headers = request.headers
        connection = headers.get("Connection")
        if connection:  # names listed in Connection are hop-by-hop too: no cached verdicts
            drop = _DROP_REQUEST_HEADERS | {t.strip().lower() for t in connection.split(",")}
            lines = _header_lines(request.raw_headers, drop, {})
        else:
            lines = _header_lines(
                request.raw_headers, _DROP_REQUEST_HEADERS, self._request_verdicts
            )
        if self.config.proxy.forward_authorization and "Authorization" in headers:
            auth = headers["Authorization"].encode("utf-8", "surrogateescape")
            lines.append(b"Authorization: %b\r\n" % auth)
        elif engine_key:
            lines.append(self._engine_auth(engine_key))
        lines.append(f"x-request-id: {rid}\r\n".encode())
        return b"".join(lines)

    def _engine_auth(self, key: str) -> bytes:
        """``Authorization: Bearer <key>`` for an engine's configured key, encoded once."""
        line = self._auth_lines.get(key)
        if line is None:
            if "\r" in key or "\n" in key:
                raise ValueError("an engine api_key contains CR or LF")
            line = self._auth_lines[key] = f"Authorization: Bearer {key}\r\n".encode()
        return line

    # -- the path ----------------------------------------------------------------------------

    async def handle(
        self, request: Incoming, kind: str, body: bytes | None, sink: Sink, rid: str
    ) -> Reply:
        """Serve one inference request.

        Parameters
        ----------
        request : Incoming
            Its ``path`` and ``headers``.
        kind : {"chat", "completions", "embeddings"}
            The endpoint.
        body : bytes or None
            The whole request body; None if it was over ``limits.max_body_bytes`` (413).
        sink : Sink
            Where a streamed (SSE) response is written.
        rid : str
            The request id the front end assigned (:func:`new_request_id`).

        Returns
        -------
        Reply
            The response; ``streamed=True`` if it already went through ``sink``.
        """
        ctx = self.ctx
        loop = self._running_loop()
        t0 = loop.time()
        record = DecisionRecord(request_id=rid, endpoint=request.path)
        metrics = ctx.metrics
        metrics.in_flight_count += 1
        response: Reply | None = None
        try:
            try:
                if body is None:
                    raise self._too_large()
                parsed = self._parse(kind, body)
                record.model = parsed.model or ""
                cls = self._classify(request, parsed)
                if self._marginal and self.config.policy_for(cls.cls) in self._marginal:
                    self._slos(request, cls)
            except _Reject as rej:
                # Never routed, but recorded: the client has the request id to ask why.
                record.error = rej.reason
                ctx.decisions.add(record)
                response = rej.response
                return response
            record.model, record.priority, record.tenant = cls.model, cls.priority, cls.tenant
            record.class_name, record.row = cls.cls.name, cls.row
            record.zones = self._zone_list(cls.zones)
            ctx.decisions.add(record)
            response = await self._route(request, kind, body, parsed, cls, record, t0, sink)
            return response
        finally:
            metrics.in_flight_count -= 1
            status = response.status if response is not None else 499
            record.status = status
            record.timings["done"] = loop.time() - t0
            engine = record.attempts[-1].engine if record.attempts else "none"
            metrics.count_request(record.class_name or "none", engine, status)
            if ctx.aggregator is not None and status == 429 and record.attempts:
                ctx.aggregator.observe_rejected(int(ctx.fleet.row_keys[record.row]))
            if response is not None and status < 400:
                metrics.e2e_of(record.class_name, engine).observe(loop.time() - t0)

    def _zone_list(self, zones: frozenset[str]) -> list[str]:
        """``sorted(zones)`` for the record, cached (a handful of distinct sets)."""
        out = self._sorted_zones.get(zones)
        if out is None:
            if len(self._sorted_zones) >= 1024:
                self._sorted_zones.clear()
            out = self._sorted_zones[zones] = sorted(zones)
        return list(out)

    async def _route(
        self,
        request: Incoming,
        kind: str,
        body: bytes,
        parsed: ParsedRequest,
        cls: _Classified,
        record: DecisionRecord,
        t0: float,
        sink: Sink,
    ) -> Reply:
        ctx, config, fleet = self.ctx, self.config, self.ctx.fleet
        key, source = routing_key(
            parsed, request.headers, config.proxy.session_header, request_id=record.request_id
        )
        record.key_source = str(source)
        state = fleet.state
        record.generation = state.generation
        retry_after = {"Retry-After": str(config.admission.retry_after_s)}
        if should_shed(key, float(state.shed_fraction[cls.row])):
            ctx.metrics.shed.labels(cls.cls.name, "shed").inc()
            if ctx.aggregator is not None:
                ctx.aggregator.observe_request(
                    int(fleet.row_keys[cls.row]), estimate_prompt_tokens(parsed), shed=True
                )
            record.error = "shed by the controller's shed fraction"
            return error_reply(
                429,
                "The service is shedding load for this class; retry later.",
                code="load_shed",
                headers=retry_after,
            )
        admission = ctx.admission
        if admission is None:
            return await self._pick_and_forward(
                request, kind, body, parsed, cls, record, t0, key, sink
            )
        try:
            queued = admission.try_acquire()  # no coroutine unless it has to wait
            if queued is not None:
                await admission.wait(queued)
        except AdmissionRejected as exc:
            ctx.metrics.shed.labels(cls.cls.name, "admission").inc()
            if ctx.aggregator is not None:
                ctx.aggregator.observe_request(
                    int(fleet.row_keys[cls.row]), estimate_prompt_tokens(parsed), shed=True
                )
            record.error = str(exc)
            return error_reply(
                429,
                "The proxy is overloaded; retry later.",
                code="overloaded",
                headers={"Retry-After": exc.admission.retry_after_header},
            )
        try:
            return await self._pick_and_forward(
                request, kind, body, parsed, cls, record, t0, key, sink
            )
        finally:
            admission.release()

    async def _pick_and_forward(
        self,
        request: Incoming,
        kind: str,
        body: bytes,
        parsed: ParsedRequest,
        cls: _Classified,
        record: DecisionRecord,
        t0: float,
        key: int,
        sink: Sink,
    ) -> Reply:
        ctx, config, fleet = self.ctx, self.config, self.ctx.fleet
        if ctx.pd is not None and kind != "embeddings" and cls.model in ctx.pd.models:
            return await self._pd_forward(request, body, parsed, cls, record, t0, key, sink)
        loop = self._running_loop()
        name = config.policy_for(cls.cls)
        policy = ctx.policies[name]
        mask = fleet.request_mask(cls.zones, cls.hardware)
        load = fleet.load if name in self._marginal else None
        make_view = fleet.view if load is None else fleet.load_view
        view = make_view(mask)
        state = view.state
        prompt_tokens = estimate_prompt_tokens(parsed) if kind != "embeddings" else 0
        prefix = _prefix(parsed) if policy.needs_prefix else b""
        if load is None:
            route = RouteRequest(
                key_hash=key, row=cls.row, prompt_tokens=prompt_tokens, prefix=prefix
            )
        else:
            route = MarginalRequest(
                key_hash=key,
                row=cls.row,
                prompt_tokens=prompt_tokens,
                prefix=prefix,
                tenant=cls.tenant or None,
                slo_ttft_s=cls.slo_ttft_s,
                slo_tpot_s=cls.slo_tpot_s,
            )
        if ctx.aggregator is not None:
            ctx.aggregator.observe_request(int(fleet.row_keys[cls.row]), route.prompt_tokens)
        decision = policy.choose(route, view, k=config.policy.top_k)
        unenforced = None
        if load is not None and decision.reason == REASON_SLO_INFEASIBLE and not load.calibrated():
            # Not calibrated yet: a reject would rest on nominal constants, and would
            # never let them calibrate. Route best-effort, without the SLO.
            unenforced = decision
            route = msgspec.structs.replace(route, slo_ttft_s=None, slo_tpot_s=None)
            decision = policy.choose(route, view, k=config.policy.top_k)
        capped = not decision.ranked and fleet.capped_out(cls.row, state, mask)
        if capped:
            # Candidates exist but are at their max_concurrency cap: wait for one to
            # free up (bounded; this request holds an admission slot), then pick again.
            wait_until = loop.time() + config.admission.max_wait_s
            while capped and await fleet.caps.wait_freed(wait_until - loop.time()):
                view = make_view(mask)
                state = view.state
                decision = policy.choose(route, view, k=config.policy.top_k)
                capped = not decision.ranked and fleet.capped_out(cls.row, state, mask)
        record.policy, record.reason = decision.policy, decision.reason
        record.defer(_choice_renderer(fleet, cls.row, mask, state, decision))
        record.timings["decided"] = loop.time() - t0
        if load is not None:
            record.prediction = _prediction(decision, load, decision.ranked)
            if unenforced is not None:
                record.prediction["slo_unenforced"] = _unenforced(unenforced)
            if decision.reason == REASON_SLO_INFEASIBLE:
                return self._slo_infeasible(cls, record, decision)
        if capped:
            ctx.metrics.shed.labels(cls.cls.name, "at_cap").inc()
            record.error = "every candidate engine is at its max_concurrency cap"
            return error_reply(
                429,
                f"Every engine for model `{cls.model}` is at its concurrency limit; retry later.",
                code="engines_at_capacity",
                headers={
                    "Retry-After": str(config.admission.retry_after_s),
                    "x-fastroute-engine": "none",
                    "x-fastroute-decision": record.header(),
                },
            )
        if not decision.ranked:
            record.error = "no eligible engine"
            return error_reply(
                503,
                f"No engine is available for model `{cls.model}` (priority {cls.priority}, "
                f"zones {', '.join(sorted(cls.zones))}).",
                code="no_engine_available",
                headers={"x-fastroute-engine": "none", "x-fastroute-decision": record.header()},
            )
        self._deposit(state)
        deadline = t0 + config.timeouts.total_timeout_s
        return await self._try_ranked(
            request, body, cls, record, route, policy, decision, deadline, t0, sink, fleet,
            load=load,
        )  # fmt: skip

    def _slo_infeasible(
        self, cls: _Classified, record: DecisionRecord, decision: Decision
    ) -> Reply:
        """429 for a request no engine is predicted to serve within its SLO (early:
        nothing is forwarded)."""
        detail = getattr(decision, "detail", "") or "no engine is predicted to meet the SLO"
        record.error = f"{REASON_SLO_INFEASIBLE}: {detail}"
        self.ctx.metrics.shed.labels(cls.cls.name, REASON_SLO_INFEASIBLE).inc()
        return error_reply(
            429,
            f"No engine for model `{cls.model}` is predicted to meet the request's latency "
            f"objective ({REASON_SLO_INFEASIBLE}): {detail}. Retry later or relax the SLO.",
            code="slo_infeasible",
            headers={
                "Retry-After": str(self.config.admission.retry_after_s),
                "x-fastroute-engine": "none",
                "x-fastroute-decision": record.header(),
            },
        )

    async def _pd_forward(
        self,
        request: Incoming,
        body: bytes,
        parsed: ParsedRequest,
        cls: _Classified,
        record: DecisionRecord,
        t0: float,
        key: int,
        sink: Sink,
    ) -> Reply:
        """A P/D request: prefill on the prefill pool, then decode (relayed) on the
        decode pool (:mod:`fastroute.proxy.pd`)."""
        ctx, config = self.ctx, self.config
        pd = ctx.pd
        assert pd is not None
        loop = self._running_loop()
        name = config.policy_for(cls.cls)
        p_fleet, d_fleet = pd.prefill, pd.decode
        p_cls = replace(cls, row=p_fleet.rows[(cls.model, cls.priority)])
        d_cls = replace(cls, row=d_fleet.rows[(cls.model, cls.priority)])
        p_mask = p_fleet.request_mask(cls.zones, cls.hardware)
        d_mask = d_fleet.request_mask(cls.zones, cls.hardware)
        p_view, d_view = p_fleet.view(p_mask), d_fleet.view(d_mask)
        p_policy, d_policy = pd.prefill_policies[name], pd.decode_policies[name]
        prefix = _prefix(parsed) if p_policy.needs_prefix or d_policy.needs_prefix else b""
        p_load = d_load = None
        if name in self._marginal:
            p_load, d_load = p_fleet.load, d_fleet.load
        if p_load is not None and d_load is not None:
            p_view, d_view = p_fleet.load_view(p_mask), d_fleet.load_view(d_mask)
            p_route: RouteRequest = MarginalRequest(
                key_hash=key,
                row=p_cls.row,
                prompt_tokens=estimate_prompt_tokens(parsed),
                prefix=prefix,
                tenant=cls.tenant or None,
                slo_ttft_s=cls.slo_ttft_s,
                slo_tpot_s=cls.slo_tpot_s,
            )
        else:
            p_route = RouteRequest(
                key_hash=key,
                row=p_cls.row,
                prompt_tokens=estimate_prompt_tokens(parsed),
                prefix=prefix,
            )
        d_route = msgspec.structs.replace(p_route, row=d_cls.row)
        if ctx.aggregator is not None:
            ctx.aggregator.observe_request(int(p_fleet.row_keys[p_cls.row]), p_route.prompt_tokens)
        selector = pd.selector(name)
        p_dec, d_dec = selector.choose_pair(p_route, d_route, p_view, d_view, config.policy.top_k)
        unenforced = None
        if (
            p_load is not None
            and d_load is not None
            and p_dec.reason == REASON_SLO_INFEASIBLE
            and not (p_load.calibrated(("prefill",)) and d_load.calibrated(("decode",)))
        ):
            unenforced = p_dec  # not calibrated yet: best-effort (see _pick_and_forward)
            p_route = msgspec.structs.replace(p_route, slo_ttft_s=None, slo_tpot_s=None)
            d_route = msgspec.structs.replace(d_route, slo_ttft_s=None, slo_tpot_s=None)
            p_dec, d_dec = selector.choose_pair(
                p_route, d_route, p_view, d_view, config.policy.top_k
            )
        record.policy = p_dec.policy
        record.reason = f"pd:prefill={p_dec.reason},decode={d_dec.reason}"
        record.defer(
            _pd_renderer(
                _choice_renderer(p_fleet, p_cls.row, p_mask, p_view.state, p_dec),
                _choice_renderer(d_fleet, d_cls.row, d_mask, d_view.state, d_dec),
            )
        )
        record.timings["decided"] = loop.time() - t0
        if p_load is not None and d_load is not None:
            record.prediction = {
                "prefill": _prediction(p_dec, p_load, p_dec.ranked),
                "decode": _prediction(d_dec, d_load, d_dec.ranked),
            }
            pair = getattr(selector, "last", None)
            if pair is not None:
                record.prediction.update(
                    ttft_s=pair.ttft_s,
                    tpot_s=pair.tpot_s,
                    transfer_s=pair.transfer_s,
                    cost_s=pair.cost_s,
                    output_tokens=pair.output_tokens,
                )
            if unenforced is not None:
                record.prediction["slo_unenforced"] = _unenforced(unenforced)
            if p_dec.reason == REASON_SLO_INFEASIBLE:
                return self._slo_infeasible(cls, record, p_dec)
        for stage, decision in (("prefill", p_dec), ("decode", d_dec)):
            if not decision.ranked:
                record.error = f"no eligible {stage} engine"
                return error_reply(
                    503,
                    f"No {stage} engine is available for model `{cls.model}` (priority "
                    f"{cls.priority}, zones {', '.join(sorted(cls.zones))}).",
                    code="no_engine_available",
                    headers={
                        "x-fastroute-engine": "none",
                        "x-fastroute-decision": record.header(),
                    },
                )
        self._deposit(ctx.fleet.state)
        deadline = t0 + config.timeouts.total_timeout_s
        original = msgspec.json.decode(body)  # parsed above: a JSON object
        try:
            reply = await self._try_ranked(
                request,
                prefill_body(original),
                p_cls,
                record,
                p_route,
                p_policy,
                p_dec,
                deadline,
                t0,
                _NO_STREAM,
                p_fleet,
                "prefill",
                load=p_load,
            )
            if reply.status != 200:
                return reply  # the prefill pool's error (after its retry), in OpenAI shape
            params = transfer_params(reply.body)
        except PDProtocolError as exc:
            return self._pd_protocol_error(record, str(exc))
        except _PrefillStreamed:
            return self._pd_protocol_error(record, "the prefill engine answered a stream")
        record.timings["prefilled"] = loop.time() - t0
        return await self._try_ranked(
            request,
            decode_body(original, params),
            d_cls,
            record,
            d_route,
            d_policy,
            d_dec,
            deadline,
            t0,
            sink,
            d_fleet,
            "decode",
            load=d_load,
        )

    def _pd_protocol_error(self, record: DecisionRecord, why: str) -> Reply:
        record.error = why
        return error_reply(
            502,
            f"Engine {record.attempts[-1].engine}: {why}.",
            code="upstream_error",
            headers=self._decision_headers(record),
        )

    def _deposit(self, state: FleetState) -> None:
        """One retry-budget deposit for a request about to be forwarded."""
        budget = self.ctx.budget
        if state is not self._budget_state:  # the ratio changes only with the table
            self._budget_state = state
            ratio = self.config.retry.ratio
            budget.set_ratio(ratio if state.retry_ratio is None else min(ratio, state.retry_ratio))
        budget.deposit(time.monotonic())

    async def _try_ranked(
        self,
        request: Incoming,
        body: bytes,
        cls: _Classified,
        record: DecisionRecord,
        route: RouteRequest,
        policy: Policy,
        decision: Decision,
        deadline: float,
        t0: float,
        sink: Sink,
        fleet: Fleet,
        stage: str | None = None,
        *,
        load: EngineLoad | None = None,
    ) -> Reply:
        """Attempt the ranked engines of ``fleet`` in order, retries within the budget.

        ``load``: the fleet's engine load, tracked and calibrated per attempt
        (``marginal-cost`` classes only).
        """
        ctx = self.ctx
        last: UpstreamError | Reply | None = None
        for rank, index in enumerate(decision.ranked):
            if rank > 0:
                if not ctx.budget.may_retry(rank - 1, time.monotonic()):
                    if rank <= ctx.budget.max_retries:
                        ctx.metrics.retry_refused.inc()
                        record.error = "retry refused by the retry budget"
                    break
                ctx.metrics.retries.inc()
            try:
                return await self._attempt(
                    request,
                    body,
                    cls,
                    record,
                    route,
                    policy,
                    rank,
                    index,
                    deadline,
                    t0,
                    sink,
                    fleet,
                    stage,
                    load,
                )
            except _Retryable as exc:
                last = exc.failure
        assert last is not None
        if isinstance(last, Reply):
            return last
        return error_reply(
            last.status,
            last.message,
            code=last.code,
            headers=self._decision_headers(record),
        )

    def _decision_headers(self, record: DecisionRecord) -> dict[str, str]:
        engine = record.attempts[-1].engine if record.attempts else "none"
        return {
            "x-fastroute-engine": engine,
            "x-fastroute-decision": record.header(),
        }

    def _record_outcome(self, fleet: Fleet, index: int, outcome: Outcome, attempt: Attempt) -> None:
        ctx = self.ctx
        attempt.outcome = _OUTCOME_TEXT[outcome]
        if outcome in _FAILURE_OUTCOMES:
            ctx.metrics.upstream_failures.labels(attempt.engine, attempt.outcome).inc()
        if fleet.outlier.record(index, outcome, fleet.clock()):
            ctx.metrics.ejections.labels(attempt.engine).inc()
        if ctx.aggregator is not None:
            ok = outcome is Outcome.SUCCESS
            ctx.aggregator.observe_attempt(int(fleet.engine_ids[index]), ok, attempt.outcome)

    async def _attempt(
        self,
        request: Incoming,
        body: bytes,
        cls: _Classified,
        record: DecisionRecord,
        route: RouteRequest,
        policy: Policy,
        rank: int,
        index: int,
        deadline: float,
        t0: float,
        sink: Sink,
        fleet: Fleet,
        stage: str | None = None,
        load: EngineLoad | None = None,
    ) -> Reply:
        ctx = self.ctx
        assert ctx.upstream is not None
        upstream = ctx.upstream
        loop = self._running_loop()
        engine = fleet.engines[index]
        engine_id = int(fleet.engine_ids[index])
        attempt = Attempt(engine=engine.name, rank=rank, stage=stage)
        record.attempts.append(attempt)
        started = loop.time()
        policy.on_routed(route, engine_id)
        fleet.attempt_started(index, route.prompt_tokens)
        tracked: AttemptLoad | None = None
        if load is not None:
            tracked = load.admit(index, route, started, decode_stage=stage == "decode")
        ok = False
        try:
            headers = self._forward_headers(request, engine.api_key, record.request_id)
            try:
                resp = await upstream.open(engine, request.path, body, headers, deadline)
            except UpstreamError as exc:
                attempt.detail = exc.message
                self._record_outcome(fleet, index, exc.outcome, attempt)
                raise _Retryable(exc) from None
            try:
                record.timings.setdefault("first_byte", loop.time() - t0)
                attempt.status = resp.status
                if resp.status >= 400:
                    return await self._upstream_error(
                        fleet, resp, engine.name, index, attempt, record, deadline
                    )
                if resp.content_type == "text/event-stream":
                    result = await self._relay_stream(
                        fleet, sink, resp, cls, record, index, attempt, deadline, t0, tracked
                    )
                else:
                    try:
                        data = upstream.complete_body(resp, engine.name)  # no wait: common
                        if data is None:
                            data = await upstream.read_body(resp, engine.name, deadline)
                    except UpstreamError as exc:
                        attempt.detail = exc.message
                        self._record_outcome(fleet, index, exc.outcome, attempt)
                        raise _Retryable(exc) from None
                    self._record_outcome(fleet, index, Outcome.SUCCESS, attempt)
                    if tracked is not None:
                        tracked.body(data)
                    if ctx.aggregator is not None:
                        row_key = int(fleet.row_keys[cls.row])
                        ctx.aggregator.observe_output(row_key, completion_tokens_of(data))
                    raw_head = self._response_headers(resp, record)
                    result = Reply(resp.status, [], data, raw_head=raw_head)
                ok = attempt.outcome == "success"
                return result
            finally:
                resp.close()  # no-op once the body was read to its end
        finally:
            attempt.duration_s = loop.time() - started
            fleet.attempt_finished(index, route.prompt_tokens)
            if tracked is not None:
                assert load is not None
                load.release(tracked, ok, loop.time())
            if ok:
                fleet.observe(index, Ewma.E2E_S, loop.time() - t0)
            policy.on_complete(route, engine_id, ok)

    def _response_headers(self, resp: Response, record: DecisionRecord) -> bytes:
        """The engine's headers to relay plus the proxy's, as encoded lines.

        Relayed as received, minus the drop set (:func:`_header_lines`).
        """
        lines = _header_lines(resp.raw_headers, _DROP_RESPONSE_HEADERS, self._response_verdicts)
        engine = record.attempts[-1].engine if record.attempts else "none"
        lines.append(
            f"x-fastroute-engine: {engine}\r\nx-fastroute-decision: {record.header()}\r\n".encode(
                "utf-8", "surrogateescape"
            )
        )
        return b"".join(lines)

    async def _upstream_error(
        self,
        fleet: Fleet,
        resp: Response,
        engine: str,
        index: int,
        attempt: Attempt,
        record: DecisionRecord,
        deadline: float,
    ) -> Reply:
        """An engine answered >= 400 before any byte reached the client."""
        assert self.ctx.upstream is not None
        status = resp.status
        try:
            data = await self.ctx.upstream.read_body(resp, engine, deadline)
        except UpstreamError:
            data = b""
        if status >= 500:
            outcome = Outcome.HTTP_5XX
        elif status == 429:
            outcome = Outcome.RATE_LIMITED
        else:
            outcome = Outcome.CLIENT_ERROR
        self._record_outcome(fleet, index, outcome, attempt)
        attempt.detail = f"engine answered {status}"
        if status >= 500:
            err = UpstreamError(Outcome.HTTP_5XX, f"engine {engine} answered {status}")
            if status in self.config.retry.retry_on_status:
                raise _Retryable(err)
            return error_reply(
                502, err.message, code=err.code, headers=self._decision_headers(record)
            )
        message, etype, param, code = self._scrub_error(fleet, data, engine, status)
        headers = self._decision_headers(record)
        if "Retry-After" in resp.headers:
            headers["Retry-After"] = resp.headers["Retry-After"]
        response = error_reply(status, message, code=code, param=param, type=etype, headers=headers)
        if status in self.config.retry.retry_on_status:
            raise _Retryable(response)
        return response

    def _scrub_error(
        self, fleet: Fleet, data: bytes, engine: str, status: int
    ) -> tuple[str, str | None, str | None, str | None]:
        """Message, type, param, code of an engine's error body, without its address."""
        message = f"Engine {engine} rejected the request (HTTP {status})."
        etype = param = code = None
        try:
            err = msgspec.json.decode(data)["error"]
            if isinstance(err, dict):
                message = str(err.get("message") or message)
                etype = err.get("type") if isinstance(err.get("type"), str) else None
                param = err.get("param") if isinstance(err.get("param"), str) else None
                code = err.get("code") if isinstance(err.get("code"), str) else None
        except (msgspec.DecodeError, KeyError, TypeError):
            pass
        e = fleet.engines[fleet.names.index(engine)]
        netloc = e.url.split("://", 1)[-1]
        for secret in (e.url, netloc):
            message = message.replace(secret, f"<{engine}>")
        return message, etype, param, code

    async def _relay_stream(
        self,
        fleet: Fleet,
        sink: Sink,
        resp: Response,
        cls: _Classified,
        record: DecisionRecord,
        index: int,
        attempt: Attempt,
        deadline: float,
        t0: float,
        tracked: AttemptLoad | None = None,
    ) -> Reply:
        """Relay an SSE body chunk by chunk; the first chunk is read before committing.

        ``tracked`` (``marginal-cost`` classes): told of the first chunk and every chunk.
        """
        ctx = self.ctx
        assert ctx.upstream is not None
        upstream = ctx.upstream
        loop = self._running_loop()
        timeouts = self.config.timeouts
        try:
            chunk = await upstream.read_chunk(
                resp, attempt.engine, timeouts.first_byte_timeout_s, deadline
            )
            if not chunk:
                raise UpstreamError(
                    Outcome.CONNECT_ERROR, f"engine {attempt.engine} sent an empty stream"
                )
        except UpstreamError as exc:
            attempt.detail = exc.message
            self._record_outcome(fleet, index, exc.outcome, attempt)
            raise _Retryable(exc) from None
        headers = [("Cache-Control", "no-cache")]
        await sink.start(resp.status, headers, self._response_headers(resp, record))
        first_at = loop.time()
        if tracked is not None:
            tracked.first_token(first_at)
        record.timings["first_token"] = first_at - t0
        labels = (cls.cls.name, attempt.engine)
        ctx.metrics.ttft_of(*labels).observe(first_at - t0)
        fleet.observe(index, Ewma.TTFT_S, first_at - t0)
        tally = _StreamTally(chunk, tracked)
        failure: UpstreamError | None = None
        try:
            await sink.write(chunk)
            tally.add(chunk, first_at)
            splice = sink.splice()
            if splice is not None:
                # The engine's chunks go to the client from the connection's callback:
                # this coroutine only wakes at the end (or on a failure or timeout).
                tally.splice = splice
                splice.on_writable(resp.resume_reading)
                resp.relay(tally.relay)
                try:
                    await upstream.wait_end(resp, attempt.engine, deadline)
                except UpstreamError as exc:
                    failure = exc
                finally:
                    splice.on_writable(None)
            else:
                while True:
                    try:
                        chunk = await upstream.read_chunk(
                            resp, attempt.engine, timeouts.idle_timeout_s, deadline
                        )
                    except UpstreamError as exc:
                        failure = exc
                        break
                    if not chunk:
                        break
                    await sink.write(chunk)
                    tally.add(chunk, loop.time())
            if failure is not None:
                attempt.detail = f"stream broke after {tally.n_chunks} chunks: {failure.message}"
                self._record_outcome(fleet, index, failure.outcome, attempt)
                record.error = attempt.detail
                sep = b"" if tally.last.endswith(_SSE_END) else _SSE_END
                await sink.write(sep + sse_error_event(failure.message, code=failure.code))
            else:
                self._record_outcome(fleet, index, Outcome.SUCCESS, attempt)
            await sink.end()
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
            attempt.outcome = "client_disconnected"
            record.error = "client disconnected mid-stream"
        # TBOT over token events: the role event comes with the first token and [DONE]
        # with the last, so the span first..last chunk covers n_tokens - 1 gaps
        n_tokens = output_events(tally.n_events, tally.n_usage, tally.first, tally.last)
        tbot_s: float | None = None
        if n_tokens > 1:
            tbot_s = (tally.last_at - first_at) / (n_tokens - 1)
            record.timings["tbot_s"] = tbot_s
            ctx.metrics.tbot_of(*labels).observe(tbot_s)
            fleet.observe(index, Ewma.TBOT_S, tbot_s)
        if ctx.aggregator is not None:
            engine_id = int(fleet.engine_ids[index])
            ctx.aggregator.observe_latency(engine_id, first_at - t0, tbot_s)
            ctx.aggregator.observe_output(int(fleet.row_keys[cls.row]), n_tokens)
        return Reply(resp.status, headers, streamed=True)


class _StreamTally:
    """What a relayed SSE body carried: chunks, ``data:`` events, usage events, the first
    and last chunk and when the last arrived (for TBOT and output lengths).

    ``tracked`` (``marginal-cost`` classes) is told of every chunk. With ``splice`` set,
    :meth:`relay` is the engine connection's callback (:meth:`Response.relay`).
    """

    __slots__ = ("n_chunks", "n_events", "n_usage", "first", "last", "last_at", "tracked", "splice")

    def __init__(self, first: bytes, tracked: AttemptLoad | None) -> None:
        self.n_chunks = self.n_events = self.n_usage = 0
        self.first = first
        self.last = b""  # the last chunk written; its tail is only looked at on failure
        self.last_at = 0.0
        self.tracked = tracked
        self.splice: Splice | None = None

    def add(self, chunk: bytes, now: float) -> None:
        """Count a chunk written to the client at ``now``."""
        self.n_chunks += 1
        self.n_events += chunk.count(DATA_PREFIX)
        self.n_usage += chunk.count(USAGE_MARK)
        self.last = chunk
        self.last_at = now
        if self.tracked is not None:
            self.tracked.chunk(chunk, now)

    def relay(self, chunk: bytes, now: float, last: bool) -> bool:
        """Write a chunk to the client (``last``: the engine's body ended with it, so
        end the client's too) and count it; False when the client is full."""
        assert self.splice is not None
        writable = self.splice.write_now(chunk, last)
        self.add(chunk, now)
        return writable


class _Retryable(Exception):
    """An attempt failed before any byte reached the client; the next candidate may try."""

    def __init__(self, failure: UpstreamError | Reply) -> None:
        super().__init__(str(failure))
        self.failure = failure


def _choice_renderer(
    fleet: Fleet, row: int, mask: Any, state: FleetState, decision: Decision
) -> Any:
    """The deferred ``(candidates, filters)`` of a decision record.

    Captures what may change later (the state, the ejection reasons) at decision time;
    names, weights and explanations are rendered only if the record is read.
    """
    reasons = fleet.ejection_reasons()
    at_cap = fleet.cap_reasons()

    def render() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        scores = decision.scores
        candidates = [
            {
                "engine": fleet.names[i],
                "rank": r,
                "weight": float(state.weights[row, i]),
                "score": None if scores is None else scores[r],
            }
            for r, i in enumerate(decision.ranked)
        ]
        return candidates, fleet.explain(row, mask, state, reasons, at_cap)

    return render


def _prediction(decision: Decision, load: EngineLoad, ranked: Sequence[int]) -> dict[str, Any]:
    """What ``marginal-cost`` predicted, for the decision record: the chosen (or best,
    when rejected) engine's TTFT/TPOT, the output length and cached tokens assumed,
    the marginal cost of each ranked candidate (``candidates[].score`` too), and the
    calibration sample counts of the engine types involved."""
    types = {load.types[i] for i in ranked} or set(load.types)
    calibration = load.calibration
    out: dict[str, Any] = {"cost_s": list(decision.scores or ())}
    if isinstance(decision, MarginalDecision):
        out.update(
            ttft_s=decision.ttft_s,
            tpot_s=decision.tpot_s,
            output_tokens=decision.output_tokens,
            cached_tokens=decision.cached_tokens,
        )
        if decision.detail:
            out["detail"] = decision.detail
    out["calibration_samples"] = {
        t: dict(calibration.model(t).samples_by_kind) for t in sorted(types)
    }
    return out


def _unenforced(rejected: Decision) -> str:
    """Why a request the policy found SLO-infeasible was routed anyway."""
    detail = getattr(rejected, "detail", "") or REASON_SLO_INFEASIBLE
    return (
        f"{detail}; routed without the SLO: the calibration has fewer than "
        f"{MIN_SAMPLES_TO_REJECT} samples per engine type and kind"
    )


def _pd_renderer(prefill: Any, decode: Any) -> Any:
    """The deferred ``(candidates, filters)`` of a P/D decision, tagged by stage."""

    def render() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        candidates: list[dict[str, Any]] = []
        filters: list[dict[str, Any]] = []
        for stage, renderer in (("prefill", prefill), ("decode", decode)):
            c, f = renderer()
            candidates += [{**x, "stage": stage} for x in c]
            filters += [{**x, "stage": stage} for x in f]
        return candidates, filters

    return render


class _PrefillStreamed(Exception):
    """A prefill engine answered an SSE stream where JSON was asked for."""


class _NoStream:
    """The sink of a step that must not stream (the prefill step asks for JSON)."""

    async def start(self, status: int, headers: Any, raw_head: bytes = b"") -> None:
        raise _PrefillStreamed

    async def write(self, data: bytes) -> None:
        raise _PrefillStreamed

    async def end(self) -> None:
        raise _PrefillStreamed

    def splice(self) -> None:
        return None


_NO_STREAM = _NoStream()


def _prefix(parsed: ParsedRequest) -> bytes:
    """Leading prompt text for prefix-aware policies."""
    if isinstance(parsed, ChatRequest):
        parts: list[str] = []
        size = 0
        for message in parsed.messages:
            content = message.content
            text = (
                content
                if isinstance(content, str)
                else " ".join(p.text or "" for p in content or [] if p.type == "text")
            )
            parts.append(text)
            size += len(text)
            if size >= PREFIX_BYTES:
                break
        return "\n".join(parts).encode()[:PREFIX_BYTES]
    prompt = parsed.prompt
    if isinstance(prompt, str):
        return prompt[:PREFIX_BYTES].encode()[:PREFIX_BYTES]
    if prompt and isinstance(prompt[0], str):
        return prompt[0][:PREFIX_BYTES].encode()[:PREFIX_BYTES]
    return b""
