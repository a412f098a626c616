"""The proxy's routes besides the request path: which path is what, and the ``GET`` answers.

:class:`~fastroute.proxy.proxy_app.ProxyApp` dispatches with these; every answer is a
:class:`~fastroute.proxy.http.reply.Reply` the front end writes.

Routes
------
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``
    The request path (:mod:`fastroute.proxy.path.handler`); see :data:`INFERENCE_PATHS`.
``POST /v1/responses``, ``POST /v1/messages``, ``POST /v1/messages/count_tokens``
    The same path, routed like chat (:mod:`fastroute.proxy.path.api_endpoints`).
``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``
    To the engine that stored the response
    (:mod:`fastroute.proxy.path.stored_responses`).
The engine endpoints (``/tokenize``, ``/pooling``, ``/score``, ``/rerank``, ``/classify``,
``/v1/audio/*``... and ``proxy.passthrough_paths``)
    :mod:`fastroute.proxy.path.endpoints`, on the request path of
    :mod:`fastroute.proxy.path.endpoint_handler`.
``GET /v1/models``
    What the engines' own ``/v1/models`` report, their union in OpenAI list shape
    (:mod:`fastroute.proxy.background.models_scrape`); the configured engines' models
    before any engine answered.
``GET /health``, ``GET``/``POST /ping``
    200 while serving, 503 once draining (SIGTERM); JSON with this worker's ``pid``.
    (``/ping`` is vLLM's SageMaker alias of ``/health``: the proxy's own liveness.)
``GET /ready``
    200 once a weight source is loaded (the table, or the config fallback);
    ``unserved_models`` names the models the config names that no engine serves (503
    when that is all of them); ``stale_table`` describes a table found at start whose writer
    was gone (name, generation, age now, epoch, the start rule's reason, whether it is used),
    until a live writer publishes (absent otherwise).
``/version``, ``/load``
    Not routed: engine-scoped (an engine's build, an engine's in-flight count) with no
    model to route by; 404 ``not_routed`` saying so. Ask the engine itself.
``GET /metrics``
    Prometheus text (:mod:`fastroute.proxy.metrics`).
``GET /admin/decisions/{request_id}``
    The full decision record; only from loopback or with ``proxy.admin_token`` as a
    bearer token.
``/admin/engines`` and below
    The fleet admin API, same access rule: :mod:`fastroute.proxy.admin_engines`.
``GET /admin/queue``
    ``{"engines": {name: tokens}}``: the prompt tokens this host's attempts (every worker's)
    have queued on each engine, engines with none left out; same access rule. The other
    proxies of the deployment poll it (``proxy.peers``,
    :mod:`fastroute.proxy.background.peer_queues`). Their own queues are not in it. With
    ``X-Fastroute-Key-Log-Since: <position>`` it adds ``key_log``, the host's own key-log
    entries from that position (:mod:`fastroute.policy.key_exchange`); a position other
    than -1 or an integer from 0 to 2**63 - 1 is a 400 ``bad_key_log_position``.

Unknown routes and wrong methods get OpenAI-shaped 404/405 errors.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from fastroute.policy.key_exchange import SINCE_HEADER
from fastroute.proxy.background.models_scrape import ModelCard, models_body
from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.path.handler import ProxyContext

if TYPE_CHECKING:
    from fastroute.proxy.background.start_table import StartTable

__all__ = [
    "INFERENCE_PATHS",
    "ENGINE_SCOPED_PATHS",
    "QUEUE_PATH",
    "is_get_path",
    "queued_by_engine",
    "get_reply",
    "not_allowed",
    "unknown_url",
    "other_reply",
]

#: The request path's endpoints (``POST`` only) and their handler kind.
INFERENCE_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
}
#: The ``GET`` endpoints (besides ``/admin/decisions/{request_id}``).
_GET_PATHS = ("/v1/models", "/health", "/ready", "/metrics")
_DECISIONS_PREFIX = "/admin/decisions/"
#: This host's queued prompt tokens per engine (what peers poll).
QUEUE_PATH = "/admin/queue"
#: vLLM's liveness alias (``GET`` or ``POST``), answered like ``/health``.
_PING_PATH = "/ping"
#: Engine paths the proxy does not route, and why.
ENGINE_SCOPED_PATHS = {
    "/version": "an engine's software version; engines may differ, ask one directly",
    "/load": "one engine's count of requests in flight; the proxy's load is on /metrics",
}


def is_get_path(path: str) -> bool:
    """``path`` is one of the ``GET`` routes (decision records included)."""
    return path in _GET_PATHS or path == QUEUE_PATH or path.startswith(_DECISIONS_PREFIX)


def not_allowed(method: str, path: str, allowed: tuple[str, ...]) -> Reply:
    """405 for ``method`` on ``path``, naming the ``allowed`` methods."""
    return error_reply(
        405,
        f"Method {method} is not allowed on {path}; allowed: {', '.join(allowed)}.",
        code="method_not_allowed",
    )


def unknown_url(method: str, path: str) -> Reply:
    """404 for a path no route serves."""
    return error_reply(404, f"Unknown request URL: {method} {path}.", code="unknown_url")


def _json_reply(data: object, status: int = 200) -> Reply:
    return Reply(status, [("Content-Type", "application/json")], msgspec.json.encode(data))


def get_reply(
    ctx: ProxyContext,
    path: str,
    headers: Mapping[str, str],
    remote: str | None,
    start: StartTable | None = None,
) -> Reply:
    """Answer a ``GET`` route (:func:`is_get_path`) from the context in force.

    Parameters
    ----------
    ctx : ProxyContext
        The context new requests use.
    path : str
        The request path, without the query string.
    headers : mapping
        Request headers (``Authorization`` for the admin routes).
    remote : str or None
        The client's address (admin routes are open to loopback).
    start : StartTable, optional
        The start rule's verdict (``/ready``'s ``stale_table``).

    Returns
    -------
    Reply
    """
    if path == "/v1/models":
        return _json_reply(models_body(_model_cards(ctx)))
    if path == "/health":
        return _health_reply(ctx)
    if path == "/ready":
        return _ready_reply(ctx, start)
    if path == "/metrics":
        ctx.metrics.table_generation.set(ctx.fleet.state.generation)
        return Reply(200, [("Content-Type", "text/plain; version=0.0.4")], ctx.metrics.render())
    if not _admin_allowed(ctx, headers, remote):
        return _forbidden()
    if path == QUEUE_PATH:
        return _queue_reply(ctx, headers)
    return _decision_reply(ctx, path[len(_DECISIONS_PREFIX) :])


def _model_cards(ctx: ProxyContext) -> list[ModelCard]:
    if ctx.models is not None:
        return ctx.models.cards(ctx.config)
    created = int(time.time())
    return [ModelCard(id=m, created=created) for m in ctx.config.models()]


def _health_reply(ctx: ProxyContext) -> Reply:
    pid = os.getpid()
    if ctx.draining:
        return _json_reply({"status": "draining", "pid": pid}, 503)
    return _json_reply({"status": "ok", "pid": pid})


def _ready_reply(ctx: ProxyContext, start: StartTable | None) -> Reply:
    state = ctx.fleet.state
    unserved = ctx.models.unserved(ctx.config) if ctx.models is not None else []
    body: dict[str, object] = {
        "ready": ctx.ready,
        "weights": state.source,
        "generation": state.generation,
        "unserved_models": unserved,
    }
    stale = start.ready_info() if start is not None else None
    if stale is not None:
        body["stale_table"] = stale
    serving = len(unserved) < len(ctx.config.models())
    return _json_reply(body, 200 if ctx.ready and not ctx.draining and serving else 503)


def other_reply(ctx: ProxyContext, method: str, path: str) -> Reply:
    """The answer to a path that is neither an inference route, a ``GET`` route nor an
    engine endpoint: ``/ping`` (the proxy's liveness), 404 ``not_routed`` for
    :data:`ENGINE_SCOPED_PATHS`, else 404 ``unknown_url``."""
    if path == _PING_PATH:
        if method not in ("GET", "HEAD", "POST"):
            return not_allowed(method, path, ("GET", "HEAD", "POST"))
        return _health_reply(ctx)
    why = ENGINE_SCOPED_PATHS.get(path)
    if why is not None:
        return error_reply(404, f"{path} is not routed by the proxy: {why}.", code="not_routed")
    return unknown_url(method, path)


def _is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


def _admin_allowed(ctx: ProxyContext, headers: Mapping[str, str], remote: str | None) -> bool:
    """Loopback, or the ``proxy.admin_token`` bearer token (every admin route)."""
    token = ctx.config.proxy.admin_token
    if token is not None:
        given = headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return True
    return _is_loopback(remote)


def _forbidden() -> Reply:
    return error_reply(403, "Admin endpoints need loopback or the admin token.", code="forbidden")


def queued_by_engine(ctx: ProxyContext) -> dict[str, int]:
    """This host's queued prompt tokens per engine name (every worker's when the stats
    block is shared), engines with none left out; peers' queues are not included."""
    fleet = ctx.fleet
    queued = fleet.stats.own_queued_tokens()
    return {fleet.names[i]: int(queued[i]) for i in np.flatnonzero(queued > 0)}


def _queue_reply(ctx: ProxyContext, headers: Mapping[str, str]) -> Reply:
    """``GET /admin/queue``: this host's queued prompt tokens per engine and, when the
    poller names a position in :data:`~fastroute.policy.key_exchange.SINCE_HEADER`, its
    key log's own entries from there (``key_log``; absent without a log)."""
    body: dict[str, object] = {"engines": queued_by_engine(ctx)}
    since = headers.get(SINCE_HEADER)
    if since is not None:
        try:
            position = int(since)
        except ValueError:
            position = -2
        if not -1 <= position < 1 << 63:
            return error_reply(
                400,
                f"{SINCE_HEADER} must be a key-log position (-1 or an integer from 0 to "
                f"2**63 - 1), got {since[:64]!r}.",
                code="bad_key_log_position",
            )
        if ctx.key_exchange is not None:
            body["key_log"] = ctx.key_exchange.export(position)
    return _json_reply(body)


def _decision_reply(ctx: ProxyContext, rid: str) -> Reply:
    record = ctx.decisions.get(rid) if rid and "/" not in rid else None
    if record is None:
        return error_reply(
            404,
            f"No decision record for request id {rid!r} (unknown or evicted).",
            code="decision_not_found",
        )
    return Reply(200, [("Content-Type", "application/json")], record.to_json())


#: The access rule of every admin route (decision records, the fleet admin API).
admin_allowed = _admin_allowed
