"""The request path of the engine endpoints (:mod:`fastroute.proxy.path.endpoints`).

:class:`EndpointHandler` is the inference handler with two steps of its own and
everything else shared: the body limit of the endpoint (413) and its parse (400), then
the same classification (401/403/404), sticky shed, admission, decision record,
ranked attempts, retries and relay as chat. Its requests are decided by
``least-request`` (fewest in flight, host-wide) over the model's engines, whatever the
class's policy; a P/D model's go to its decode pool (both pools' engines answer these
endpoints; the decode pool is the one that serves whole responses). Being a subclass,
it adds no work to the chat path.
"""

from __future__ import annotations

from fastroute.config import ClassConfig
from fastroute.policy import LeastRequest
from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.path.classify import Reject
from fastroute.proxy.path.endpoints import ENDPOINTS, PASSTHROUGH, Endpoint
from fastroute.proxy.path.handler import InferenceHandler, ProxyContext
from fastroute.proxy.path.request_state import RequestState
from fastroute.proxy.path.requests import RequestParseError
from fastroute.proxy.path.strategy import PlainStrategy

__all__ = ["EndpointHandler", "ENDPOINT_KINDS", "ROUTING_POLICY"]

#: The policy every engine endpoint is routed by.
ROUTING_POLICY = "least-request"
#: The endpoints by kind (the ``kind`` a request is handled as).
ENDPOINT_KINDS: dict[str, Endpoint] = {e.kind: e for e in (*ENDPOINTS.values(), PASSTHROUGH)}


class EndpointHandler(InferenceHandler):
    """The handler of the engine endpoints over one :class:`ProxyContext`."""

    #: None of them takes the P/D path (their response is not a generation).
    whole_only_kinds = frozenset(ENDPOINT_KINDS)

    def __init__(self, ctx: ProxyContext) -> None:
        super().__init__(ctx)
        top_k = ctx.config.policy.top_k
        self._least = PlainStrategy(ROUTING_POLICY, ctx.fleet, LeastRequest(), top_k)
        self._least_decode = (
            PlainStrategy(ROUTING_POLICY, ctx.pd.decode, LeastRequest(), top_k)
            if ctx.pd is not None
            else None
        )

    def _classify(self, state: RequestState) -> ClassConfig:
        """Body limit and parse of the endpoint, then the shared classification."""
        endpoint = ENDPOINT_KINDS[state.kind]
        limit_bytes, field = endpoint.body_limit(self.config)
        body = state.body
        if body is None or len(body) > limit_bytes:
            raise Reject(
                error_reply(
                    413,
                    f"Request body is larger than the limit of {limit_bytes} bytes ({field}).",
                    code="request_too_large",
                )
            )
        try:
            parsed = endpoint.parse(body, state.request.headers)
        except RequestParseError as exc:
            err = exc.to_openai_error()["error"]
            raise Reject(
                error_reply(400, str(err["message"]), param=err["param"], code=None)
            ) from None
        if not parsed.model:
            raise Reject(
                error_reply(
                    400,
                    "You must provide a model parameter.",
                    param="model",
                    code="missing_model",
                )
            )
        state.parsed = parsed
        state.record.model = parsed.model
        cls = self._classifier.classify(state)
        state.strategy = self._least
        return cls

    async def _pick_and_forward(self, state: RequestState) -> Reply:
        """Least-loaded over the main fleet; a P/D model's over its decode pool."""
        pd = self.ctx.pd
        if pd is None or self._least_decode is None or state.model not in pd.models:
            return await super()._pick_and_forward(state)
        main_row = state.row
        state.strategy = self._least_decode
        state.row = pd.decode.rows[(state.model, state.priority)]
        try:
            return await super()._pick_and_forward(state)
        finally:
            state.row = main_row
