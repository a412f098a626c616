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
A client that goes away cancels the handler (aiohttp ``handler_cancellation``); the
upstream response is closed on the way out.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict

from fastroute.config import PRIORITIES, ClassConfig, Config, TenantConfig, hash_api_key
from fastroute.policy import Decision, Policy, RouteRequest, make_policy
from fastroute.proxy.admission import AdmissionQueue, AdmissionRejected, should_shed
from fastroute.proxy.decisions import Attempt, DecisionLog, DecisionRecord
from fastroute.proxy.fleet import Fleet, FleetState
from fastroute.proxy.http1 import Response
from fastroute.proxy.metrics import ProxyMetrics
from fastroute.proxy.openai_errors import error_response, sse_error_event
from fastroute.proxy.outlier import Outcome
from fastroute.proxy.requests import (
    ChatRequest,
    CompletionRequest,
    ParsedRequest,
    RequestParseError,
    parse_chat,
    parse_completion,
)
from fastroute.proxy.retry_budget import RetryBudget
from fastroute.proxy.routing_key import estimate_prompt_tokens, routing_key
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


def _filter_headers(
    items: Any, drop: frozenset[str], verdicts: dict[str, bool]
) -> list[tuple[str, str]]:
    """The (name, value) pairs of ``items`` that pass ``drop``.

    ``verdicts`` caches the decision per name as sent: clients and engines send the
    same few header names over and over, and lowercasing plus three tests per header
    showed in the profile.
    """
    out: list[tuple[str, str]] = []
    for name, value in items:
        keep = verdicts.get(name)
        if keep is None:
            keep = _forwardable(name.lower(), drop)
            if len(verdicts) >= MAX_CACHED_HEADER_NAMES:
                verdicts.clear()
            verdicts[name] = keep
        if keep:
            out.append((name, value))
    return out


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


class _Reject(Exception):
    """A request refused before routing; carries the response."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


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
    aggregator : DemandAggregator or None
        Per-window report counters, set by ``install_signal_tasks`` when a
        controller is configured; None: nothing is counted.
    """

    config: Config
    fleet: Fleet
    policies: dict[str, Policy]
    budget: RetryBudget
    admission: AdmissionQueue | None
    decisions: DecisionLog
    metrics: ProxyMetrics
    upstream: UpstreamPool | None = None
    aggregator: DemandAggregator | None = None
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


def request_id_of(request: web.Request) -> str:
    """The request's id, assigned on first use."""
    # Not ``request.get``: the generic ``Mapping.get`` of aiohttp's request costs more.
    try:
        return request[_REQUEST_ID]
    except KeyError:
        rid = request[_REQUEST_ID] = new_request_id()
        return rid


def assign_request_id(request: web.Request) -> str:
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
        self._request_verdicts: dict[str, bool] = {}
        self._response_verdicts: dict[str, bool] = {}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        return await self._handle(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        return await self._handle(request, "completions")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/embeddings`` (passthrough)."""
        return await self._handle(request, "embeddings")

    # -- steps -------------------------------------------------------------------------------

    def _too_large(self) -> _Reject:
        limit = self.config.limits.max_body_bytes
        return _Reject(
            error_response(
                413,
                f"Request body is larger than the limit of {limit} bytes.",
                code="request_too_large",
            )
        )

    async def _read_body(self, request: web.Request) -> bytes:
        length = request.content_length
        if length is not None and length > self.config.limits.max_body_bytes:
            raise self._too_large()
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large() from None

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
                error_response(400, str(err["message"]), param=err["param"], code=None)
            ) from None
        if not parsed.model:
            raise _Reject(
                error_response(
                    400,
                    "You must provide a model parameter.",
                    param="model",
                    code="missing_model",
                )
            )
        return parsed

    def _tenant(self, request: web.Request) -> TenantConfig | None:
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
            raise _Reject(
                error_response(401, "Invalid or missing API key.", code="invalid_api_key")
            )
        return tenant

    def _classify(self, request: web.Request, parsed: ParsedRequest) -> _Classified:
        proxy = self.config.proxy
        tenant = self._tenant(request)
        zones = frozenset(tenant.zones) if tenant and tenant.zones else self._all_zones
        narrow = request.headers.get(proxy.zone_header)
        if narrow is not None:
            asked = frozenset(z.strip() for z in narrow.split(",") if z.strip())
            zones = zones & asked
            if not zones:
                raise _Reject(
                    error_response(
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
                error_response(
                    400,
                    f"Header {proxy.priority_header} must be one of {', '.join(PRIORITIES)}; "
                    f"got {priority!r}.",
                    code="invalid_priority",
                )
            )
        model = str(parsed.model)
        if model not in self._models:
            raise _Reject(
                error_response(
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

    def _forward_headers(
        self, request: web.Request, engine_key: str | None, rid: str
    ) -> CIMultiDict[str]:
        headers = request.headers
        connection = headers.get("Connection")
        if connection:  # names listed in Connection are hop-by-hop too: no cached verdicts
            drop = _DROP_REQUEST_HEADERS | {t.strip().lower() for t in connection.split(",")}
            pairs = _filter_headers(headers.items(), drop, {})
        else:
            pairs = _filter_headers(headers.items(), _DROP_REQUEST_HEADERS, self._request_verdicts)
        if self.config.proxy.forward_authorization and "Authorization" in headers:
            pairs.append(("Authorization", headers["Authorization"]))
        elif engine_key:
            pairs.append(("Authorization", f"Bearer {engine_key}"))
        pairs.append(("x-request-id", rid))
        return CIMultiDict(pairs)  # built once: add() per header costs more

    # -- the path ----------------------------------------------------------------------------

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        ctx = self.ctx
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        rid = request_id_of(request)
        record = DecisionRecord(request_id=rid, endpoint=request.path)
        metrics = ctx.metrics
        metrics.in_flight.inc()
        response: web.StreamResponse | None = None
        try:
            try:
                body = await self._read_body(request)
                parsed = self._parse(kind, body)
                cls = self._classify(request, parsed)
            except _Reject as rej:
                response = rej.response
                return response
            record.model, record.priority, record.tenant = cls.model, cls.priority, cls.tenant
            record.class_name, record.row = cls.cls.name, cls.row
            record.zones = self._zone_list(cls.zones)
            ctx.decisions.add(record)
            response = await self._route(request, kind, body, parsed, cls, record, t0)
            return response
        finally:
            metrics.in_flight.dec()
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
        request: web.Request,
        kind: str,
        body: bytes,
        parsed: ParsedRequest,
        cls: _Classified,
        record: DecisionRecord,
        t0: float,
    ) -> web.StreamResponse:
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
            return error_response(
                429,
                "The service is shedding load for this class; retry later.",
                code="load_shed",
                headers=retry_after,
            )
        admission = ctx.admission
        if admission is None:
            return await self._pick_and_forward(request, kind, body, parsed, cls, record, t0, key)
        try:
            await admission.acquire()
        except AdmissionRejected as exc:
            ctx.metrics.shed.labels(cls.cls.name, "admission").inc()
            if ctx.aggregator is not None:
                ctx.aggregator.observe_request(
                    int(fleet.row_keys[cls.row]), estimate_prompt_tokens(parsed), shed=True
                )
            record.error = str(exc)
            return error_response(
                429,
                "The proxy is overloaded; retry later.",
                code="overloaded",
                headers={"Retry-After": exc.admission.retry_after_header},
            )
        try:
            return await self._pick_and_forward(request, kind, body, parsed, cls, record, t0, key)
        finally:
            admission.release()

    async def _pick_and_forward(
        self,
        request: web.Request,
        kind: str,
        body: bytes,
        parsed: ParsedRequest,
        cls: _Classified,
        record: DecisionRecord,
        t0: float,
        key: int,
    ) -> web.StreamResponse:
        ctx, config, fleet = self.ctx, self.config, self.ctx.fleet
        loop = asyncio.get_running_loop()
        policy = ctx.policies[config.policy_for(cls.cls)]
        mask = fleet.request_mask(cls.zones, cls.hardware)
        view = fleet.view(mask)
        state = view.state
        route = RouteRequest(
            key_hash=key,
            row=cls.row,
            prompt_tokens=estimate_prompt_tokens(parsed) if kind != "embeddings" else 0,
            prefix=_prefix(parsed) if policy.needs_prefix else b"",
        )
        if ctx.aggregator is not None:
            ctx.aggregator.observe_request(int(fleet.row_keys[cls.row]), route.prompt_tokens)
        decision = policy.choose(route, view, k=config.policy.top_k)
        record.policy, record.reason = decision.policy, decision.reason
        record.defer(_choice_renderer(fleet, cls.row, mask, state, decision))
        record.timings["decided"] = loop.time() - t0
        if not decision.ranked:
            record.error = "no eligible engine"
            return error_response(
                503,
                f"No engine is available for model `{cls.model}` (priority {cls.priority}, "
                f"zones {', '.join(sorted(cls.zones))}).",
                code="no_engine_available",
                headers={"x-fastroute-engine": "none", "x-fastroute-decision": record.header()},
            )
        ctx.budget.set_ratio(
            config.retry.ratio
            if state.retry_ratio is None
            else min(config.retry.ratio, state.retry_ratio)
        )
        ctx.budget.deposit(time.monotonic())
        deadline = t0 + config.timeouts.total_timeout_s
        last: UpstreamError | web.Response | None = None
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
                    request, body, cls, record, route, policy, rank, index, deadline, t0
                )
            except _Retryable as exc:
                last = exc.failure
        assert last is not None
        if isinstance(last, web.Response):
            return last
        return error_response(
            last.status,
            last.message,
            code=last.code,
            headers=self._decision_headers(record),
        )

    def _decision_headers(self, record: DecisionRecord) -> dict[str, str]:
        engine = record.attempts[-1].engine if record.attempts else "none"
        return {
            "x-request-id": record.request_id,
            "x-fastroute-engine": engine,
            "x-fastroute-decision": record.header(),
        }

    def _record_outcome(self, index: int, outcome: Outcome, attempt: Attempt) -> None:
        ctx = self.ctx
        attempt.outcome = _OUTCOME_TEXT[outcome]
        if outcome in _FAILURE_OUTCOMES:
            ctx.metrics.upstream_failures.labels(attempt.engine, attempt.outcome).inc()
        if ctx.fleet.outlier.record(index, outcome, ctx.fleet.clock()):
            ctx.metrics.ejections.labels(attempt.engine).inc()
        if ctx.aggregator is not None:
            ok = outcome is Outcome.SUCCESS
            ctx.aggregator.observe_attempt(int(ctx.fleet.engine_ids[index]), ok, attempt.outcome)

    async def _attempt(
        self,
        request: web.Request,
        body: bytes,
        cls: _Classified,
        record: DecisionRecord,
        route: RouteRequest,
        policy: Policy,
        rank: int,
        index: int,
        deadline: float,
        t0: float,
    ) -> web.StreamResponse:
        ctx, fleet = self.ctx, self.ctx.fleet
        assert ctx.upstream is not None
        upstream = ctx.upstream
        loop = asyncio.get_running_loop()
        engine = fleet.engines[index]
        engine_id = int(fleet.engine_ids[index])
        attempt = Attempt(engine=engine.name, rank=rank)
        record.attempts.append(attempt)
        started = loop.time()
        policy.on_routed(route, engine_id)
        fleet.attempt_started(index)
        ok = False
        try:
            headers = self._forward_headers(request, engine.api_key, record.request_id)
            try:
                resp = await upstream.open(engine, request.path, body, headers, deadline)
            except UpstreamError as exc:
                attempt.detail = exc.message
                self._record_outcome(index, exc.outcome, attempt)
                raise _Retryable(exc) from None
            try:
                record.timings.setdefault("first_byte", loop.time() - t0)
                attempt.status = resp.status
                if resp.status >= 400:
                    return await self._upstream_error(
                        resp, engine.name, index, attempt, record, deadline
                    )
                if resp.content_type == "text/event-stream":
                    result = await self._relay_stream(
                        request, resp, cls, record, index, attempt, deadline, t0
                    )
                else:
                    try:
                        data = await upstream.read_body(resp, engine.name, deadline)
                    except UpstreamError as exc:
                        attempt.detail = exc.message
                        self._record_outcome(index, exc.outcome, attempt)
                        raise _Retryable(exc) from None
                    self._record_outcome(index, Outcome.SUCCESS, attempt)
                    if ctx.aggregator is not None:
                        row_key = int(fleet.row_keys[cls.row])
                        ctx.aggregator.observe_output(row_key, completion_tokens_of(data))
                    result = web.Response(
                        status=resp.status, body=data, headers=self._response_headers(resp, record)
                    )
                ok = attempt.outcome == "success"
                return result
            finally:
                resp.close()  # no-op once the body was read to its end
        finally:
            attempt.duration_s = loop.time() - started
            fleet.attempt_finished(index)
            if ok:
                fleet.observe(index, Ewma.E2E_S, loop.time() - t0)
            policy.on_complete(route, engine_id, ok)

    def _response_headers(
        self, resp: Response, record: DecisionRecord
    ) -> list[tuple[str, str]]:
        """The engine's headers to relay plus the proxy's, as pairs: aiohttp's
        ``Response`` copies its ``headers`` argument into a new multidict anyway."""
        pairs = _filter_headers(
            resp.headers.items(), _DROP_RESPONSE_HEADERS, self._response_verdicts
        )
        pairs.extend(self._decision_headers(record).items())
        return pairs

    async def _upstream_error(
        self,
        resp: Response,
        engine: str,
        index: int,
        attempt: Attempt,
        record: DecisionRecord,
        deadline: float,
    ) -> web.Response:
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
        self._record_outcome(index, outcome, attempt)
        attempt.detail = f"engine answered {status}"
        if status >= 500:
            err = UpstreamError(Outcome.HTTP_5XX, f"engine {engine} answered {status}")
            if status in self.config.retry.retry_on_status:
                raise _Retryable(err)
            return error_response(
                502, err.message, code=err.code, headers=self._decision_headers(record)
            )
        message, etype, param, code = self._scrub_error(data, engine, status)
        headers = self._decision_headers(record)
        if "Retry-After" in resp.headers:
            headers["Retry-After"] = resp.headers["Retry-After"]
        response = error_response(
            status, message, code=code, param=param, type=etype, headers=headers
        )
        if status in self.config.retry.retry_on_status:
            raise _Retryable(response)
        return response

    def _scrub_error(
        self, data: bytes, engine: str, status: int
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
        e = self.ctx.fleet.engines[self.ctx.fleet.names.index(engine)]
        netloc = e.url.split("://", 1)[-1]
        for secret in (e.url, netloc):
            message = message.replace(secret, f"<{engine}>")
        return message, etype, param, code

    async def _relay_stream(
        self,
        request: web.Request,
        resp: Response,
        cls: _Classified,
        record: DecisionRecord,
        index: int,
        attempt: Attempt,
        deadline: float,
        t0: float,
    ) -> web.StreamResponse:
        """Relay an SSE body chunk by chunk; the first chunk is read before committing."""
        ctx = self.ctx
        assert ctx.upstream is not None
        upstream = ctx.upstream
        loop = asyncio.get_running_loop()
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
            self._record_outcome(index, exc.outcome, attempt)
            raise _Retryable(exc) from None
        out = web.StreamResponse(status=resp.status, headers=self._response_headers(resp, record))
        out.headers["Cache-Control"] = "no-cache"
        await out.prepare(request)
        first_at = last_at = loop.time()
        record.timings["first_token"] = first_at - t0
        labels = (cls.cls.name, attempt.engine)
        ctx.metrics.ttft_of(*labels).observe(first_at - t0)
        ctx.fleet.observe(index, Ewma.TTFT_S, first_at - t0)
        n_chunks = 0
        last = b""  # the last chunk written; its tail is only looked at on failure
        failure: UpstreamError | None = None
        try:
            while chunk:
                await out.write(chunk)
                n_chunks += 1
                last_at = loop.time()
                last = chunk
                try:
                    chunk = await upstream.read_chunk(
                        resp, attempt.engine, timeouts.idle_timeout_s, deadline
                    )
                except UpstreamError as exc:
                    failure = exc
                    break
            if failure is not None:
                attempt.detail = f"stream broke after {n_chunks} chunks: {failure.message}"
                self._record_outcome(index, failure.outcome, attempt)
                record.error = attempt.detail
                sep = b"" if last.endswith(_SSE_END) else _SSE_END
                await out.write(sep + sse_error_event(failure.message, code=failure.code))
            else:
                self._record_outcome(index, Outcome.SUCCESS, attempt)
            await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            attempt.outcome = "client_disconnected"
            record.error = "client disconnected mid-stream"
        if n_chunks > 1:
            tbot = (last_at - first_at) / (n_chunks - 1)
            record.timings["tbot_s"] = tbot
            ctx.metrics.tbot_of(*labels).observe(tbot)
            ctx.fleet.observe(index, Ewma.TBOT_S, tbot)
        if ctx.aggregator is not None:
            tbot_s = record.timings.get("tbot_s") if n_chunks > 1 else None
            engine_id = int(ctx.fleet.engine_ids[index])
            ctx.aggregator.observe_latency(engine_id, first_at - t0, tbot_s)
            ctx.aggregator.observe_output(int(ctx.fleet.row_keys[cls.row]), n_chunks)
        return out


class _Retryable(Exception):
    """An attempt failed before any byte reached the client; the next candidate may try."""

    def __init__(self, failure: UpstreamError | web.Response) -> None:
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
        return candidates, fleet.explain(row, mask, state, reasons)

    return render


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
