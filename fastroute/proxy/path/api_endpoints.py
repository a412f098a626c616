"""What the Responses and the Anthropic Messages endpoints add to the chat request path.

Both are parsed into chat form (:mod:`~fastroute.proxy.path.api_requests`) and then
classified, keyed, admitted, routed and relayed exactly like chat. The request path
calls ``begin`` of the request's endpoint when the request arrives, and two hooks of
the object it returns (``state.api``; None for chat, completions and embeddings):

``begin``
    the stream meter of the dialect (:mod:`~fastroute.proxy.path.sse_dialects`); the
    Messages endpoints also wrap the sink, so an in-stream error the proxy writes is
    Anthropic's ``event: error``;
``pin``
    Responses only: a request with ``previous_response_id`` goes first to the engine
    that stored that response (the host's shared
    :class:`~fastroute.tables.response_map.ResponseMap`), when that engine is still in
    the fleet, in the request's zones and serves its model; otherwise it is routed as
    usual and the engine answers its own 404, relayed;
``finish``
    Responses: record the answered response's id → engine (from the JSON body or the
    stream's ``response.created``); Messages: rewrite an error reply in Anthropic's
    shape (:func:`~fastroute.proxy.http.anthropic_errors.to_anthropic`), the one place
    every error of these endpoints passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np

from fastroute.hashing import engine_id, key_hash
from fastroute.policy import Decision
from fastroute.proxy.http.anthropic_errors import sse_error_to_anthropic, to_anthropic
from fastroute.proxy.http.reply import Headers, Reply, Sink, Splice
from fastroute.proxy.path.api_requests import ResponsesChat
from fastroute.proxy.path.sse_dialects import AnthropicStreamMeter, ResponsesStreamMeter

if TYPE_CHECKING:
    from fastroute.proxy.path.fleet import Fleet
    from fastroute.proxy.path.request_state import RequestState
    from fastroute.tables.response_map import ResponseMap

__all__ = [
    "API_KINDS",
    "ResponsesEndpoint",
    "MessagesEndpoint",
    "build_api_endpoints",
    "pinned_index",
    "response_key",
    "PIN_REASON",
]

#: The request kinds (``routes.INFERENCE_PATHS`` values) with an endpoint here.
API_KINDS = ("responses", "messages", "count_tokens")
#: The decision reason of a request sent to the engine that stored its previous response.
PIN_REASON = "response-affinity"


class _ResponseId(msgspec.Struct):
    id: str | None = None


_id_decoder = msgspec.json.Decoder(_ResponseId)


def response_key(response_id: str) -> int:
    """The map key of a response id: its xxh3-64 hash (0, the empty entry, moved to 1)."""
    return key_hash(response_id) or 1


def pinned_index(fleet: Fleet, engine: int, model: str, mask: np.ndarray) -> int | None:
    """The index in ``fleet`` of the engine with id ``engine``, if it may serve ``model``
    under ``mask`` (None: gone, outside the request's zones, or another model's)."""
    hits = np.flatnonzero(fleet.engine_ids == np.uint64(engine))
    if not hits.size:
        return None
    index = int(hits[0])
    if not mask[index] or model not in fleet.engines[index].models:
        return None
    return index


class ResponsesEndpoint:
    """``POST /v1/responses``: dialect meter, ``previous_response_id`` affinity, id record.

    Parameters
    ----------
    responses : ResponseMap
        The host's id → engine map.
    """

    def __init__(self, responses: ResponseMap) -> None:
        self.responses = responses

    def begin(self, state: RequestState) -> _ResponsesCall:
        """The request's hooks; its stream is measured in the Responses dialect."""
        call = _ResponsesCall(self.responses)
        state.meter_type = call.new_meter
        return call


class _ResponsesCall:
    """The hooks of one Responses request (it keeps the stream's meter for its id)."""

    __slots__ = ("responses", "meter")

    def __init__(self, responses: ResponseMap) -> None:
        self.responses = responses
        self.meter: ResponsesStreamMeter | None = None

    def new_meter(self, strip_usage: bool) -> ResponsesStreamMeter:
        """The meter of the relayed stream (the relay asks for one per attempt)."""
        self.meter = ResponsesStreamMeter(strip_usage)
        return self.meter

    def pin(self, state: RequestState, mask: np.ndarray, decision: Decision) -> Decision:
        """``decision`` with the engine that stored the previous response first, if known."""
        parsed = state.parsed
        fleet = state.fleet
        if not isinstance(parsed, ResponsesChat) or not parsed.previous_response_id:
            return decision
        assert fleet is not None
        engine = self.responses.get(response_key(parsed.previous_response_id))
        if engine is None:
            return decision
        index = pinned_index(fleet, engine, state.model, mask)
        if index is None:
            return decision
        ranked = (index, *(i for i in decision.ranked if i != index))
        ids = tuple(int(fleet.engine_ids[i]) for i in ranked)
        return Decision(ranked=ranked, engine_ids=ids, policy=decision.policy, reason=PIN_REASON)

    def finish(self, state: RequestState, reply: Reply) -> None:
        """Record the id of the answered response → the engine that answered it."""
        record = state.record
        if reply.status != 200 or not record.attempts:
            return
        response_id = None
        if reply.streamed:
            response_id = self.meter.response_id if self.meter is not None else None
        else:
            try:
                response_id = _id_decoder.decode(reply.body).id
            except msgspec.DecodeError:
                response_id = None
        if response_id:
            self.responses.put(response_key(response_id), engine_id(record.attempts[-1].engine))


class _AnthropicSink:
    """A sink whose proxy-written in-stream error is Anthropic's ``event: error``."""

    __slots__ = ("inner",)

    def __init__(self, inner: Sink) -> None:
        self.inner = inner

    async def start(self, status: int, headers: Headers, raw_head: bytes = b"") -> None:
        await self.inner.start(status, headers, raw_head)

    async def write(self, data: bytes) -> None:
        await self.inner.write(sse_error_to_anthropic(data))

    async def end(self) -> None:
        await self.inner.end()

    def splice(self) -> Splice | None:
        return self.inner.splice()


class MessagesEndpoint:
    """``POST /v1/messages`` and ``/count_tokens``: dialect meter, Anthropic errors."""

    def begin(self, state: RequestState) -> MessagesEndpoint:
        """Measure the stream in the Anthropic dialect; Anthropic in-stream errors. The
        endpoint is its requests' hooks (it keeps nothing per request)."""
        state.meter_type = AnthropicStreamMeter
        state.sink = _AnthropicSink(state.sink)
        return self

    def pin(self, state: RequestState, mask: np.ndarray, decision: Decision) -> Decision:
        """No affinity: Messages are stateless."""
        return decision

    def finish(self, state: RequestState, reply: Reply) -> None:
        """Every error of the endpoint in Anthropic's shape."""
        to_anthropic(reply)


def build_api_endpoints(
    responses: ResponseMap,
) -> dict[str, ResponsesEndpoint | MessagesEndpoint]:
    """The endpoint of each kind in :data:`API_KINDS`."""
    messages = MessagesEndpoint()
    return {
        "responses": ResponsesEndpoint(responses),
        "messages": messages,
        "count_tokens": messages,
    }
