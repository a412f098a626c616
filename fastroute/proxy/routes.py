"""The proxy's routes besides the request path: which path is what, and the ``GET`` answers.

:class:`~fastroute.proxy.proxy_app.ProxyApp` dispatches with these; every answer is a
:class:`~fastroute.proxy.http.reply.Reply` the front end writes.

Routes
------
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``
    The request path (:mod:`fastroute.proxy.path.handler`); see :data:`INFERENCE_PATHS`.
``GET /v1/models``
    The union of the configured engines' models, OpenAI list shape.
``GET /health``
    200 while serving, 503 once draining (SIGTERM); JSON with this worker's ``pid``.
``GET /ready``
    200 once a weight source is loaded (the table, or the config fallback).
``GET /metrics``
    Prometheus text (:mod:`fastroute.proxy.metrics`).
``GET /admin/decisions/{request_id}``
    The full decision record; only from loopback or with ``proxy.admin_token`` as a
    bearer token.
``/admin/engines`` and below
    The fleet admin API, same access rule: :mod:`fastroute.proxy.admin_engines`.

Unknown routes and wrong methods get OpenAI-shaped 404/405 errors.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import time
from collections.abc import Mapping

import msgspec

from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.path.handler import ProxyContext

__all__ = ["INFERENCE_PATHS", "is_get_path", "get_reply", "not_allowed", "unknown_url"]

#: The request path's endpoints (``POST`` only) and their handler kind.
INFERENCE_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
#: The ``GET`` endpoints (besides ``/admin/decisions/{request_id}``).
_GET_PATHS = ("/v1/models", "/health", "/ready", "/metrics")
_DECISIONS_PREFIX = "/admin/decisions/"


def is_get_path(path: str) -> bool:
    """``path`` is one of the ``GET`` routes (decision records included)."""
    return path in _GET_PATHS or path.startswith(_DECISIONS_PREFIX)


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
    ctx: ProxyContext, path: str, headers: Mapping[str, str], remote: str | None
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

    Returns
    -------
    Reply
    """
    if path == "/v1/models":
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "fastroute"}
            for m in ctx.config.models()
        ]
        return _json_reply({"object": "list", "data": data})
    if path == "/health":
        pid = os.getpid()
        if ctx.draining:
            return _json_reply({"status": "draining", "pid": pid}, 503)
        return _json_reply({"status": "ok", "pid": pid})
    if path == "/ready":
        state = ctx.fleet.state
        body = {"ready": ctx.ready, "weights": state.source, "generation": state.generation}
        return _json_reply(body, 200 if ctx.ready and not ctx.draining else 503)
    if path == "/metrics":
        ctx.metrics.table_generation.set(ctx.fleet.state.generation)
        return Reply(200, [("Content-Type", "text/plain; version=0.0.4")], ctx.metrics.render())
    return _decision_reply(ctx, path[len(_DECISIONS_PREFIX) :], headers, remote)


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


def _decision_reply(
    ctx: ProxyContext, rid: str, headers: Mapping[str, str], remote: str | None
) -> Reply:
    if not _admin_allowed(ctx, headers, remote):
        return error_reply(
            403, "Admin endpoints need loopback or the admin token.", code="forbidden"
        )
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
