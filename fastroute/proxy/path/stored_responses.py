"""``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: to the engine that
stored the response.

vLLM keeps a stored response in the memory of the engine that made it; the host's
:class:`~fastroute.tables.response_map.ResponseMap` names that engine. The request is
forwarded to it as it came (its query string is not: a retrieve is answered whole,
never streamed), and its answer relayed. An id the map does not know (never answered
through this host, or overwritten since) gets vLLM's own 404 in OpenAI shape; so does
an engine no longer in the fleet. vLLM serves no ``DELETE /v1/responses/{id}``: it is
a 404 too, saying so.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING

import numpy as np

from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.http.upstream import UpstreamError
from fastroute.proxy.path.api_endpoints import response_key
from fastroute.proxy.path.headers import HeaderRelay
from fastroute.proxy.path.relay import scrub_error

if TYPE_CHECKING:
    from fastroute.proxy.path.handler import Incoming, ProxyContext

__all__ = ["RESPONSES_PREFIX", "StoredResponses", "is_stored_response_path"]

#: The path prefix of the stored-response routes.
RESPONSES_PREFIX = "/v1/responses/"
#: What a response id may be made of (vLLM's are ``resp_`` and hex).
_RESPONSE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,256}$")
_CANCEL = "cancel"


def is_stored_response_path(path: str) -> bool:
    """``path`` is under ``/v1/responses/`` (retrieve, cancel or an unserved action)."""
    return path.startswith(RESPONSES_PREFIX)


def _not_found(response_id: str) -> Reply:
    # vLLM's message and param for an unknown id.
    return error_reply(
        404,
        f"Response with id '{response_id}' not found.",
        param="response_id",
        code="response_not_found",
        headers={"x-fastroute-engine": "none"},
    )


class StoredResponses:
    """Serves the stored-response routes of one context.

    Parameters
    ----------
    ctx : ProxyContext
        Its ``responses`` map must be set (the handler sets it).
    headers : HeaderRelay
        The handler's header verdicts.
    """

    def __init__(self, ctx: ProxyContext, headers: HeaderRelay) -> None:
        self.ctx = ctx
        self.headers = headers

    def _route(self, method: str, path: str) -> tuple[str, str] | Reply:
        """(response id, method to send) of a stored-response path, or the error reply."""
        parts = path[len(RESPONSES_PREFIX) :].split("/")
        response_id = parts[0]
        if not _RESPONSE_ID.match(response_id) or len(parts) > 2:
            return error_reply(404, f"Unknown request URL: {method} {path}.", code="unknown_url")
        if len(parts) == 2:
            if parts[1] != _CANCEL:
                return error_reply(
                    404, f"Unknown request URL: {method} {path}.", code="unknown_url"
                )
            if method != "POST":
                return error_reply(
                    405,
                    f"Method {method} is not allowed on {path}; allowed: POST.",
                    code="method_not_allowed",
                )
            return response_id, "POST"
        if method == "DELETE":
            return error_reply(
                404,
                "Deleting a stored response is not served: vLLM has no DELETE /v1/responses/{id}.",
                code="unknown_url",
            )
        if method not in ("GET", "HEAD"):
            return error_reply(
                405,
                f"Method {method} is not allowed on {path}; allowed: GET, HEAD.",
                code="method_not_allowed",
            )
        return response_id, "GET"

    async def serve(self, request: Incoming, method: str, rid: str) -> Reply:
        """Forward a stored-response request to the engine that stored the response."""
        ctx = self.ctx
        path = request.path
        routed = self._route(method, path)
        if isinstance(routed, Reply):
            return routed
        response_id, send_method = routed
        assert ctx.responses is not None and ctx.upstream is not None
        engine_id = ctx.responses.get(response_key(response_id))
        fleet = ctx.fleet
        hits = (
            np.flatnonzero(fleet.engine_ids == np.uint64(engine_id))
            if engine_id is not None
            else ()
        )
        if not len(hits):
            return _not_found(response_id)
        engine = fleet.engines[int(hits[0])]
        deadline = asyncio.get_running_loop().time() + ctx.config.timeouts.total_timeout_s
        headers = self.headers.to_engine(request, engine.api_key, rid)
        try:
            resp = await ctx.upstream.open(engine, path, b"", headers, deadline, send_method)
            try:
                data = await ctx.upstream.read_body(resp, engine.name, deadline)
            finally:
                resp.close()
        except UpstreamError as exc:
            return error_reply(
                exc.status, exc.message, code=exc.code, headers={"x-fastroute-engine": engine.name}
            )
        extra = {"x-fastroute-engine": engine.name}
        if resp.status >= 400:
            message, etype, param, code = scrub_error(fleet, data, engine.name, resp.status)
            return error_reply(
                resp.status, message, code=code, param=param, type=etype, headers=extra
            )
        return Reply(
            resp.status,
            [("Content-Type", "application/json"), *extra.items()],
            data,
        )
