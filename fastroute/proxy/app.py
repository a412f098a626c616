"""The proxy's aiohttp application: routes, middleware, lifecycle.

Routes
------
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``
    The request path (:mod:`fastroute.proxy.handler`).
``GET /v1/models``
    The union of the configured engines' models, OpenAI list shape.
``GET /health``
    200 while serving, 503 once draining (SIGTERM).
``GET /ready``
    200 once a weight source is loaded (the table, or the config fallback).
``GET /metrics``
    Prometheus text (:mod:`fastroute.proxy.metrics`).
``GET /admin/decisions/{request_id}``
    The full decision record; only from loopback or with ``proxy.admin_token`` as a
    bearer token.

Every response carries ``x-request-id``; unknown routes and wrong methods get
OpenAI-shaped 404/405 errors.

Lifecycle (``cleanup_ctx``): the upstream pool is opened on startup and closed on
cleanup; the weight table is polled once before the app reports ready, then every
``TABLE_POLL_INTERVAL_S`` by a background task. ``on_shutdown`` (after the listener
stopped, before aiohttp waits ``shutdown_timeout`` for in-flight handlers) marks the
app draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from fastroute.config import Config
from fastroute.proxy.admission import AdmissionQueue, QueueDelayGuard
from fastroute.proxy.decisions import DecisionLog
from fastroute.proxy.fleet import Fleet, FleetState, TableWatcher
from fastroute.proxy.handler import (
    InferenceHandler,
    ProxyContext,
    build_policies,
    request_id_of,
)
from fastroute.proxy.metrics import ProxyMetrics
from fastroute.proxy.openai_errors import error_response
from fastroute.proxy.retry_budget import RetryBudget
from fastroute.proxy.upstream import UpstreamPool

__all__ = ["make_app", "CONTEXT", "TABLE_POLL_INTERVAL_S"]

#: The app's :class:`~fastroute.proxy.handler.ProxyContext`.
CONTEXT = web.AppKey("fastroute_context", ProxyContext)
_WATCHER = web.AppKey("fastroute_table_watcher", TableWatcher)
#: How often the background task checks the weight table's generation, seconds.
TABLE_POLL_INTERVAL_S = 0.5

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """OpenAI-shaped 404/405, and ``x-request-id`` on every response."""
    rid = request_id_of(request)
    try:
        response = await handler(request)
    except web.HTTPNotFound:
        response = error_response(
            404, f"Unknown request URL: {request.method} {request.path}.", code="unknown_url"
        )
    except web.HTTPMethodNotAllowed as exc:
        response = error_response(
            405,
            f"Method {request.method} is not allowed on {request.path}; "
            f"allowed: {', '.join(sorted(exc.allowed_methods))}.",
            code="method_not_allowed",
        )
    if not response.prepared:
        response.headers["x-request-id"] = rid
    return response


def _is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


def make_app(config: Config, *, table_name: str | None = None) -> web.Application:
    """Build the proxy application for ``config``.

    Parameters
    ----------
    config : Config
        Validated configuration.
    table_name : str, optional
        Shared-memory weight table to follow; default ``config.proxy.table_name``.

    Returns
    -------
    aiohttp.web.Application
        Run it with ``handler_cancellation=True`` (``web.run_app`` or
        ``web.AppRunner``) so a client that disconnects cancels its upstream request.

    Raises
    ------
    fastroute.policy.PolicyConfigError
        A configured policy is not implemented or has invalid parameters.
    """
    app = web.Application(
        client_max_size=config.limits.max_body_bytes, middlewares=[_errors_middleware]
    )
    fleet = Fleet(config)
    adm = config.admission
    admission = None
    if adm.enabled:
        guard_kwargs: dict[str, float | int] = {
            "max_queue_len": adm.max_queue_len,
            "interval_s": adm.interval_s,
            "max_wait_s": adm.max_wait_s,
            "retry_after_s": float(adm.retry_after_s),
        }
        if adm.target_sojourn_s is not None:
            guard_kwargs["target_s"] = adm.target_sojourn_s
        guard = QueueDelayGuard(config.limits.max_concurrent_requests, **guard_kwargs)  # type: ignore[arg-type]
        admission = AdmissionQueue(guard)
    ctx = ProxyContext(
        config=config,
        fleet=fleet,
        policies=build_policies(config),
        budget=RetryBudget(
            ratio=config.retry.ratio,
            min_retries_per_s=config.retry.min_retries_per_s,
            ttl_s=config.retry.ttl_s,
            max_retries=config.retry.max_retries,
        ),
        admission=admission,
        decisions=DecisionLog(),
        metrics=ProxyMetrics(lambda: fleet.state.published_at),
    )
    app[CONTEXT] = ctx

    def on_change(state: FleetState) -> None:
        ctx.metrics.table_generation.set(state.generation)

    watcher = TableWatcher(
        fleet,
        table_name or config.proxy.table_name,
        interval_s=TABLE_POLL_INTERVAL_S,
        on_change=on_change,
    )
    app[_WATCHER] = watcher
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)

    inference = InferenceHandler(ctx)
    app.router.add_post("/v1/chat/completions", inference.chat)
    app.router.add_post("/v1/completions", inference.completions)
    app.router.add_post("/v1/embeddings", inference.embeddings)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/admin/decisions/{request_id}", _decision)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    ctx = app[CONTEXT]
    watcher = app[_WATCHER]
    ctx.upstream = UpstreamPool(ctx.config)
    watcher.poll()  # adopt an existing table before reporting ready
    ctx.ready = True
    task = asyncio.create_task(watcher.run(), name="fastroute-table-watcher")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        watcher.close()
        await ctx.upstream.close()


async def _on_shutdown(app: web.Application) -> None:
    app[CONTEXT].draining = True


async def _models(request: web.Request) -> web.Response:
    config = request.app[CONTEXT].config
    created = int(time.time())
    data = [
        {"id": m, "object": "model", "created": created, "owned_by": "fastroute"}
        for m in config.models()
    ]
    return web.json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    if request.app[CONTEXT].draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    state = ctx.fleet.state
    body = {"ready": ctx.ready, "weights": state.source, "generation": state.generation}
    return web.json_response(body, status=200 if ctx.ready and not ctx.draining else 503)


async def _metrics(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    ctx.metrics.table_generation.set(ctx.fleet.state.generation)
    return web.Response(
        body=ctx.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
    )


def _admin_allowed(request: web.Request) -> bool:
    token = request.app[CONTEXT].config.proxy.admin_token
    if token is not None:
        given = request.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return True
    return _is_loopback(request.remote)


async def _decision(request: web.Request) -> web.Response:
    if not _admin_allowed(request):
        return error_response(
            403, "Admin endpoints need loopback or the admin token.", code="forbidden"
        )
    rid = request.match_info["request_id"]
    record = request.app[CONTEXT].decisions.get(rid)
    if record is None:
        return error_response(
            404,
            f"No decision record for request id {rid!r} (unknown or evicted).",
            code="decision_not_found",
        )
    return web.Response(body=record.to_json(), content_type="application/json")
