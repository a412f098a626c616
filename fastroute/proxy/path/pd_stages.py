"""A P/D request as two stages of the ranked-attempt loop (:mod:`fastroute.proxy.path.pd`).

Models whose engines are SGLang's take the concurrent path of
:mod:`fastroute.proxy.path.pd_bootstrap` once the pair is decided; the rest is vLLM's
sequential protocol:

The pair is decided once (the class's :class:`~fastroute.proxy.path.strategy.PairStrategy`),
then the request state is pointed at the prefill pool (the prefill body, a sink that
refuses to stream) and forwarded, then at the decode pool (the decode body with the
prefill's ``kv_transfer_params``, the client's sink, whose usage gets the prefill's
``cached_tokens``: :mod:`fastroute.proxy.path.pd_usage`) and forwarded again, both through
:meth:`Forwarder.try_ranked <fastroute.proxy.path.forward.Forwarder.try_ranked>`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import msgspec

from fastroute.policy import Decision, RouteRequest
from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.path.classify import route_prefix
from fastroute.proxy.path.decisions import DecisionRecord
from fastroute.proxy.path.forward import Forwarder
from fastroute.proxy.path.headers import decision_headers
from fastroute.proxy.path.pd import PDProtocolError, decode_body, prefill_body, transfer_params
from fastroute.proxy.path.pd_bootstrap import BootstrapPair
from fastroute.proxy.path.pd_usage import (
    CachedTokensSink,
    prefill_cached_tokens,
    with_prefill_cached,
)
from fastroute.proxy.path.records import choice_renderer, pd_renderer
from fastroute.proxy.path.request_state import RequestState
from fastroute.proxy.path.routing_key import estimate_prompt_tokens
from fastroute.proxy.path.strategy import PairStrategy, RoutingStrategy

if TYPE_CHECKING:
    from fastroute.proxy.path.handler import ProxyContext

__all__ = ["PDStages"]


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

#: What a decided pair leaves for the stages: decisions and the requests they are for.
_Pair = tuple[Decision, Decision, RouteRequest, RouteRequest]


def _enter(state: RequestState, strategy: RoutingStrategy, route: RouteRequest, stage: str) -> None:
    """Point ``state`` at one stage: its pool, strategy, class row and request."""
    state.strategy = strategy
    state.fleet = strategy.fleet
    state.row = route.row
    state.route = route
    state.stage = stage


class PDStages:
    """Serves P/D requests of one context.

    Parameters
    ----------
    ctx : ProxyContext
    forwarder : Forwarder
    pairs : dict of str to PairStrategy
        The pair strategy of each policy name.
    """

    def __init__(
        self, ctx: ProxyContext, forwarder: Forwarder, pairs: dict[str, PairStrategy]
    ) -> None:
        self.ctx = ctx
        self.forwarder = forwarder
        self.pairs = pairs
        self.bootstrap = BootstrapPair(ctx, forwarder)

    async def forward(self, state: RequestState) -> Reply:
        """Prefill on the prefill pool, then decode (relayed) on the decode pool (or both
        at once, for SGLang engines)."""
        assert state.strategy is not None and state.body is not None
        pair = self.pairs[state.strategy.name]
        decided = self._decide(state, pair)
        if isinstance(decided, Reply):
            return decided
        p_dec, d_dec, p_route, d_route = decided
        self.forwarder.deposit(self.ctx.fleet.state)
        state.deadline = state.t0 + self.ctx.config.timeouts.total_timeout_s
        assert self.ctx.pd is not None
        if self.ctx.pd.protocols[state.model] == "bootstrap":
            prefill = dataclasses.replace(state)  # the prefill's stage, alongside the decode's
            _enter(prefill, pair.prefill, p_route, "prefill")
            prefill.decision = p_dec  # its attempts queue the prompt less the expected cache
            _enter(state, pair.decode, d_route, "decode")
            return await self.bootstrap.forward(state, prefill, p_dec, d_dec)
        original = msgspec.json.decode(state.body)  # parsed before: a JSON object
        client_sink = state.sink
        _enter(state, pair.prefill, p_route, "prefill")
        state.body, state.sink = prefill_body(original), _NO_STREAM
        record = state.record
        try:
            reply = await self.forwarder.try_ranked(state, p_dec)
            if reply.status != 200:
                return reply  # the prefill pool's error (after its retry), in OpenAI shape
            params = transfer_params(reply.body)
            cached = prefill_cached_tokens(reply.body)
        except PDProtocolError as exc:
            return _protocol_error(record, str(exc))
        except _PrefillStreamed:
            return _protocol_error(record, "the prefill engine answered a stream")
        record.timings["prefilled"] = state.loop.time() - state.t0
        _enter(state, pair.decode, d_route, "decode")
        # the client sees the prefill's cached_tokens, not the decode engine's ~100 %
        state.body = decode_body(original, params)
        state.sink = CachedTokensSink(client_sink, cached)
        reply = await self.forwarder.try_ranked(state, d_dec)
        if reply.status == 200 and not reply.streamed:
            reply.body = with_prefill_cached(reply.body, cached)
        return reply

    def _decide(self, state: RequestState, pair: PairStrategy) -> Reply | _Pair:
        """The pair's decisions, recorded; or the response refusing the request."""
        p, d = pair.prefill, pair.decode
        assert state.parsed is not None
        record = state.record
        started_ns = state.trace.now_ns() if state.trace is not None else 0
        key = (state.model, state.priority)
        p_row, d_row = p.fleet.rows[key], d.fleet.rows[key]
        p_mask = p.fleet.eligibility.request_mask(state.zones, state.hardware)
        d_mask = d.fleet.eligibility.request_mask(state.zones, state.hardware)
        p_view, d_view = p.view(p_mask), d.view(d_mask)
        needs_prefix = p.policy.needs_prefix or d.policy.needs_prefix
        limit = max(p.policy.prefix_bytes, d.policy.prefix_bytes)
        prefix = route_prefix(state.parsed, limit) if needs_prefix else b""
        p_route = p.route(state, p_row, estimate_prompt_tokens(state.parsed), prefix)
        d_route = msgspec.structs.replace(p_route, row=d_row)
        if self.ctx.aggregator is not None:
            row_key = int(p.fleet.row_keys[p_row])
            self.ctx.aggregator.observe_request(row_key, p_route.prompt_tokens)
        p_dec, d_dec, p_route, d_route = pair.decide(state, p_route, d_route, p_view, d_view)
        record.policy = p_dec.policy
        record.reason = f"pd:prefill={p_dec.reason},decode={d_dec.reason}"
        record.defer(
            pd_renderer(
                choice_renderer(p.fleet, p_row, p_mask, p_view.state, p_dec),
                choice_renderer(d.fleet, d_row, d_mask, d_view.state, d_dec),
            )
        )
        record.timings["decided"] = state.loop.time() - state.t0
        if state.trace is not None:
            state.trace.picked(started_ns, p.fleet, p_dec, p_mask, "prefill")
            state.trace.picked(started_ns, d.fleet, d_dec, d_mask, "decode")
        refused = pair.record(state, p_dec, d_dec)
        if refused is not None:
            return refused
        for stage, decision in (("prefill", p_dec), ("decode", d_dec)):
            if not decision.ranked:
                record.error = f"no eligible {stage} engine"
                return error_reply(
                    503,
                    f"No {stage} engine is available for model `{state.model}` (priority "
                    f"{state.priority}, zones {', '.join(sorted(state.zones))}).",
                    code="no_engine_available",
                    headers={
                        "x-fastroute-engine": "none",
                        "x-fastroute-decision": record.header(),
                    },
                )
        return p_dec, d_dec, p_route, d_route


def _protocol_error(record: DecisionRecord, why: str) -> Reply:
    record.error = why
    return error_reply(
        502,
        f"Engine {record.attempts[-1].engine}: {why}.",
        code="upstream_error",
        headers=decision_headers(record),
    )
