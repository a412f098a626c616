"""The inference request path (docs/design.md §3), one request at a time.

``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` run, in
order (``/v1/responses`` and ``/v1/messages`` too, routed like chat with the hooks of
:mod:`fastroute.proxy.path.api_endpoints`): body limit (413) → minimal parse (400) →
classify (tenant by API key, residency zones, priority, model → class row; unknown
model 404) → sticky shed (429) → admission guard (429) → routing key → pick (the
class's policy over a per-request :class:`~fastroute.proxy.path.fleet_views.RequestView`,
top-k ranking) → forward the original body bytes → relay the response (SSE chunk by chunk) → record.

Failures: an attempt that fails before any byte reached the client (connect error,
timeout, a status in ``retry.retry_on_status``) is retried once on the next ranked
engine if ``retry.max_retries`` and the retry budget allow; otherwise the client gets
502 (connect error, disconnect, 5xx), 504 (timeout) or the engine's 4xx/429 in
OpenAI shape. A stream that breaks after its first byte ends with one SSE error event
and a clean end of the body. Every outcome is recorded in the outlier detector.
A client that goes away cancels the handler (the lean server does);
the upstream response is closed on the way out.

The steps live in their own modules: classification (:mod:`fastroute.proxy.path.classify`),
how a class's policy is applied (:mod:`fastroute.proxy.path.strategy`: ``marginal-cost``'s
SLO headers, engine state, early 429 ``slo_infeasible`` and calibration are all there),
the ranked attempts (:mod:`fastroute.proxy.path.forward`), the relay
(:mod:`fastroute.proxy.path.relay`) and the two stages of a P/D request
(:mod:`fastroute.proxy.path.pd_stages`). One
:class:`~fastroute.proxy.path.request_state.RequestState` per request carries what they share.

The path is independent of the HTTP server in front of it: :meth:`InferenceHandler.handle`
takes anything with ``path`` and ``headers`` (a case-insensitive mapping), the body
already read (None when it was over the limit) and a :class:`~fastroute.proxy.http.reply.Sink`
for streams, and returns a :class:`~fastroute.proxy.http.reply.Reply`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastroute.config import ClassConfig, Config
from fastroute.guards.admission import should_shed
from fastroute.guards.retry_budget import RetryBudget
from fastroute.policy import Policy, make_policy
from fastroute.policy.key_exchange import KeyExchange
from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Reply, Sink
from fastroute.proxy.http.upstream import UpstreamPool
from fastroute.proxy.metrics import ProxyMetrics
from fastroute.proxy.path.admission import AdmissionQueue, AdmissionRejected
from fastroute.proxy.path.api_endpoints import build_api_endpoints
from fastroute.proxy.path.classify import PREFIX_BYTES, Classifier, Reject, route_prefix
from fastroute.proxy.path.decisions import DecisionLog, DecisionRecord
from fastroute.proxy.path.fleet import Fleet
from fastroute.proxy.path.forward import Forwarder
from fastroute.proxy.path.headers import HeaderRelay
from fastroute.proxy.path.pd import PDPools
from fastroute.proxy.path.pd_stages import PDStages
from fastroute.proxy.path.records import choice_renderer
from fastroute.proxy.path.request_state import RequestState
from fastroute.proxy.path.routing_key import estimate_prompt_tokens, routing_key
from fastroute.proxy.path.sse import ask_for_usage
from fastroute.proxy.path.stored_responses import StoredResponses
from fastroute.proxy.path.strategy import build_pair_strategies, build_strategies
from fastroute.proxy.path.tenant_limits import (
    TenantLimiter,
    tenant_admit,
    tenant_demand,
    tenant_done,
)
from fastroute.proxy.tracing import NO_TRACING
from fastroute.signals.reports import DemandAggregator
from fastroute.tables.key_log import KeyLogSegment
from fastroute.tables.response_map import ResponseMap

__all__ = [
    "ProxyContext",
    "InferenceHandler",
    "build_policies",
    "PREFIX_BYTES",
    "new_request_id",
    "Incoming",
]


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


class Incoming(Protocol):
    """What the request path reads of a request (the lean server's request is one)."""

    @property
    def path(self) -> str:
        """The request path (one of ``routes.INFERENCE_PATHS``)."""

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
    responses : ResponseMap or None
        The host's stored-response id → engine map (``previous_response_id``); None: the
        handler makes a private one (``proxy.response_map_capacity``).
    models : ModelCatalog or None
        What the engines' own ``GET /v1/models`` report
        (:mod:`fastroute.proxy.background.models_scrape`), set by ``install_signal_tasks``;
        None: the config's model list is all there is.
    tracer : Tracing or NoTracing
        The request path's tracer (:mod:`fastroute.proxy.tracing`); :data:`NO_TRACING`
        when ``tracing.enabled`` is false.
    tenants : TenantLimiter or None
        Per-tenant limits and fair shedding (:mod:`fastroute.proxy.path.tenant_limits`);
        None without tenants.
    key_log : KeyLogSegment or None
        The host's prefix-key log (``{stats_name}.keys``) the policies share with the
        other workers; None: each policy instance learns from this worker's requests only.
    key_exchange : KeyExchange or None
        This worker's end of the key exchange with the other proxies over that log
        (:mod:`fastroute.policy.key_exchange`); None without a log.
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
    responses: ResponseMap | None = None
    models: Any = None
    tracer: Any = NO_TRACING
    tenants: TenantLimiter | None = None
    key_log: KeyLogSegment | None = None
    key_exchange: KeyExchange | None = None
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

#: Kinds whose streams the proxy asks the usage event for (the others always send it,
#: or do not stream).
_CHAT_KINDS = frozenset(("chat", "completions"))


def new_request_id() -> str:
    """A fresh, unique request id (client-supplied ids are not trusted)."""
    return f"{_id_prefix}{next(_id_counter):x}"


class InferenceHandler:
    """The handlers of the inference endpoints over one :class:`ProxyContext`.

    Everything per class that does not change per request is built here: the
    classifier's tenant and zone tables, the header verdict caches, and one routing
    strategy per policy name (and per policy name and P/D pair).
    """

    #: Kinds never served disaggregated (P/D), even for a P/D model (the Responses and
    #: Messages APIs: their bodies are not chat bodies a P/D stage could rewrite).
    whole_only_kinds: frozenset[str] = frozenset(
        {"embeddings", "responses", "messages", "count_tokens"}
    )

    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx
        config = ctx.config
        self.config = config
        self._classifier = Classifier(config, ctx.fleet.rows)
        headers = HeaderRelay(config.proxy.forward_authorization)
        self._forwarder = Forwarder(ctx, headers)
        self._strategies = build_strategies(ctx)
        self._pd = PDStages(ctx, self._forwarder, build_pair_strategies(ctx))
        if ctx.responses is None:
            ctx.responses = ResponseMap.private(config.proxy.response_map_capacity)
        self._apis = build_api_endpoints(ctx.responses)
        #: ``GET /v1/responses/{id}`` and its cancel, to the engine that stored it.
        self.stored = StoredResponses(ctx, headers)
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

    # -- the path ----------------------------------------------------------------------------

    async def handle(
        self, request: Incoming, kind: str, body: bytes | None, sink: Sink, rid: str
    ) -> Reply:
        """Serve one inference request.

        Parameters
        ----------
        request : Incoming
            Its ``path`` and ``headers``.
        kind : str
            The endpoint (a value of ``routes.INFERENCE_PATHS``).
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
        state = RequestState(request, kind, body, sink, record, loop, t0)
        api = self._apis.get(kind)
        if api is not None:  # Responses, Messages: their dialect and hooks
            state.api = api.begin(state)
        tracer = ctx.tracer
        if tracer.enabled:  # off: no span, no context; the steps only test `state.trace`
            state.trace = tracer.begin(state)
        metrics = ctx.metrics
        metrics.in_flight_count += 1
        response: Reply | None = None
        try:
            trace = state.trace
            started_ns = trace.now_ns() if trace is not None else 0
            try:
                cls = self._classify(state)
            except Reject as rej:
                # Never routed, but recorded: the client has the request id to ask why.
                record.error = rej.reason
                if trace is not None:
                    trace.step("classify", started_ns, rej.reason)
                ctx.decisions.add(record)
                response = rej.response
                return response
            record.model, record.priority, record.tenant = state.model, state.priority, state.tenant
            record.class_name, record.row = cls.name, state.row
            record.zones = self._classifier.zone_list(state.zones)
            if trace is not None:
                trace.step("classify", started_ns)
            ctx.decisions.add(record)
            response = await self._route(state)
            return response
        finally:
            if state.tenant_admission is not None:  # every exit path gives the unit back
                response = tenant_done(ctx.tenants, state, response)
            if state.api is not None and response is not None:
                state.api.finish(state, response)
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
            if state.trace is not None:
                state.trace.finish(state, status)

    def _classify(self, state: RequestState) -> ClassConfig:
        """Parse and classify; pick the class's strategy (raises ``Reject``)."""
        classifier = self._classifier
        if state.body is None:
            raise classifier.too_large()
        parsed = state.parsed = classifier.parse(state.kind, state.body)
        state.record.model = parsed.model or ""
        if parsed.stream and state.kind in _CHAT_KINDS:
            # Token counts from the engine: ask for the usage event, strip it on relay.
            body = ask_for_usage(state.body, parsed.stream_options)
            if body is not None:
                state.body, state.strip_usage = body, True
        cls = classifier.classify(state)
        strategy = state.strategy = self._strategies[self.config.policy_for(cls)]
        if strategy.reads_slos:
            classifier.slos(state)
        return cls

    async def _route(self, state: RequestState) -> Reply:
        """Sticky shed and admission, then pick and forward."""
        ctx, config, fleet = self.ctx, self.config, self.ctx.fleet
        record = state.record
        assert state.parsed is not None and state.cls is not None
        key, source = routing_key(
            state.parsed,
            state.request.headers,
            config.proxy.session_header,
            request_id=record.request_id,
        )
        state.key = key
        record.key_source = str(source)
        fleet_state = fleet.state
        record.generation = fleet_state.generation
        shed_fraction = float(fleet_state.shed_fraction[state.row])
        tenants = ctx.tenants
        tokens = 0
        if tenants is not None:
            tenants.follow(fleet_state.generation, fleet_state.tenant_meta)
            shed_fraction = tenants.shed_fraction(state.tenant, shed_fraction)
            tokens = tenant_demand(ctx, state)  # offered demand: shed ones count too
        if should_shed(key, shed_fraction):
            return self._shed(state, "shed", "shed by the controller's shed fraction")
        if tenants is not None:
            refused = tenant_admit(ctx, tenants, state, tokens)
            if refused is not None:
                return refused
        admission = ctx.admission
        if admission is None:
            return await self._pick_and_forward(state)
        trace = state.trace
        started_ns = trace.now_ns() if trace is not None else 0
        try:
            queued = admission.try_acquire()  # no coroutine unless it has to wait
            if queued is not None:
                await admission.wait(queued)
        except AdmissionRejected as exc:
            if trace is not None:
                trace.step("admission", started_ns, str(exc))
            return self._shed(state, "admission", str(exc), exc.admission.retry_after_header)
        if trace is not None:
            trace.step("admission", started_ns)
        try:
            return await self._pick_and_forward(state)
        finally:
            admission.release()

    def _shed(
        self, state: RequestState, why: str, error: str, retry_after: str | None = None
    ) -> Reply:
        """429 for a request shed (``why``: ``shed`` or ``admission``) before routing."""
        ctx = self.ctx
        assert state.cls is not None and state.parsed is not None
        ctx.metrics.shed.labels(state.cls.name, why).inc()
        if ctx.aggregator is not None:
            ctx.aggregator.observe_request(
                int(ctx.fleet.row_keys[state.row]), estimate_prompt_tokens(state.parsed), shed=True
            )
        state.record.error = error
        if retry_after is None:
            return error_reply(
                429,
                "The service is shedding load for this class; retry later.",
                code="load_shed",
                headers={"Retry-After": str(self.config.admission.retry_after_s)},
            )
        return error_reply(
            429,
            "The proxy is overloaded; retry later.",
            code="overloaded",
            headers={"Retry-After": retry_after},
        )

    async def _pick_and_forward(self, state: RequestState) -> Reply:
        """Decide over the class's fleet (waiting for a capped engine if need be), then
        forward; P/D models go to their two stages."""
        ctx, config = self.ctx, self.config
        pd = ctx.pd
        if pd is not None and state.kind not in self.whole_only_kinds and state.model in pd.models:
            return await self._pd.forward(state)
        loop = state.loop
        strategy = state.strategy
        assert strategy is not None and state.parsed is not None
        started_ns = state.trace.now_ns() if state.trace is not None else 0
        fleet = state.fleet = strategy.fleet
        eligibility = fleet.eligibility
        mask = eligibility.request_mask(state.zones, state.hardware)
        view = strategy.view(mask)
        fleet_state = view.state
        prompt_tokens = estimate_prompt_tokens(state.parsed) if state.kind != "embeddings" else 0
        policy = strategy.policy
        prefix = route_prefix(state.parsed, policy.prefix_bytes) if policy.needs_prefix else b""
        route = state.route = strategy.route(state, state.row, prompt_tokens, prefix)
        if ctx.aggregator is not None:
            ctx.aggregator.observe_request(int(fleet.row_keys[state.row]), route.prompt_tokens)
        decision = strategy.decide(state, view)
        capped = not decision.ranked and eligibility.capped_out(state.row, fleet_state, mask)
        if capped:
            # Candidates exist but are at their max_concurrency cap: wait for one to
            # free up (bounded; this request holds an admission slot), then pick again.
            wait_until = loop.time() + config.admission.max_wait_s
            while capped and await fleet.caps.wait_freed(wait_until - loop.time()):
                view = strategy.view(mask)
                fleet_state = view.state
                decision = strategy.choose(state, view)
                capped = not decision.ranked and eligibility.capped_out(
                    state.row, fleet_state, mask
                )
        if state.api is not None and decision.ranked:
            decision = state.api.pin(state, mask, decision)
        record = state.record
        record.policy, record.reason = decision.policy, decision.reason
        record.defer(choice_renderer(fleet, state.row, mask, fleet_state, decision))
        record.timings["decided"] = loop.time() - state.t0
        if state.trace is not None:
            state.trace.picked(started_ns, fleet, decision, mask, state.stage)
        refused = strategy.record(state, decision)
        if refused is not None:
            return refused
        if capped or not decision.ranked:
            return self._no_engine(state, capped)
        self._forwarder.deposit(fleet_state)
        state.deadline = state.t0 + config.timeouts.total_timeout_s
        return await self._forwarder.try_ranked(state, decision)

    def _no_engine(self, state: RequestState, capped: bool) -> Reply:
        """429 when every candidate is at its cap, else 503: no eligible engine."""
        record = state.record
        assert state.cls is not None
        if capped:
            self.ctx.metrics.shed.labels(state.cls.name, "at_cap").inc()
            record.error = "every candidate engine is at its max_concurrency cap"
            return error_reply(
                429,
                f"Every engine for model `{state.model}` is at its concurrency limit; retry later.",
                code="engines_at_capacity",
                headers={
                    "Retry-After": str(self.config.admission.retry_after_s),
                    "x-fastroute-engine": "none",
                    "x-fastroute-decision": record.header(),
                },
            )
        record.error = "no eligible engine"
        return error_reply(
            503,
            f"No engine is available for model `{state.model}` (priority {state.priority}, "
            f"zones {', '.join(sorted(state.zones))}).",
            code="no_engine_available",
            headers={"x-fastroute-engine": "none", "x-fastroute-decision": record.header()},
        )
