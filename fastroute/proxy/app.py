"""The proxy's aiohttp application: routes, middleware, lifecycle.

Routes
------
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``
    The request path (:mod:`fastroute.proxy.handler`).
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

Every response carries ``x-request-id`` and ``x-fastroute-worker`` (the pid of the
worker process that answered); unknown routes and wrong methods get
OpenAI-shaped 404/405 errors.

Lifecycle (``cleanup_ctx``): the upstream pool is opened on startup and closed on
cleanup; the weight table is polled once before the app reports ready, then every
``TABLE_POLL_INTERVAL_S`` by a background task. ``on_shutdown`` (after the listener
stopped, before aiohttp waits ``shutdown_timeout`` for in-flight handlers) marks the
app draining.

Reload (:func:`reload_config`, on SIGHUP in ``fastroute serve`` workers): the request
path's objects are grouped in a *generation* (context, handler, table watcher); a
reload builds a new one and routes new requests to it, while requests already running
finish on theirs. :func:`current_context` is the context in force.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import Counter

from fastroute.config import Config, ConfigError, load_config
from fastroute.policy import PolicyConfigError
from fastroute.proxy.admission import AdmissionQueue, QueueDelayGuard
from fastroute.proxy.decisions import DecisionLog
from fastroute.proxy.fleet import Fleet, FleetState, TableWatcher
from fastroute.proxy.handler import (
    InferenceHandler,
    ProxyContext,
    assign_request_id,
    build_policies,
)
from fastroute.proxy.metrics import ProxyMetrics
from fastroute.proxy.openai_errors import error_response
from fastroute.proxy.retry_budget import RetryBudget
from fastroute.proxy.signal_tasks import install_signal_tasks
from fastroute.proxy.upstream import UpstreamPool
from fastroute.tables.stats import StatsBlock

__all__ = ["make_app", "reload_config", "current_context", "CONTEXT", "TABLE_POLL_INTERVAL_S"]

logger = logging.getLogger(__name__)

#: The app's first :class:`~fastroute.proxy.handler.ProxyContext` (see
#: :func:`current_context` for the one in force after a reload).
CONTEXT = web.AppKey("fastroute_context", ProxyContext)

#: How often the background task checks the weight table's generation, seconds.
TABLE_POLL_INTERVAL_S = 0.5

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """OpenAI-shaped 404/405, and ``x-request-id`` on every response."""
    rid = assign_request_id(request)
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


@dataclass(eq=False)
class _Generation:
    """One config's request-path objects; in-flight requests finish on their own."""

    ctx: ProxyContext
    handler: InferenceHandler
    watcher: TableWatcher
    task: asyncio.Task[None] | None = None
    active: int = 0
    retired: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class _Live:
    """The app's current generation, and the retired ones still finishing requests."""

    current: _Generation
    stats_block: StatsBlock | None
    table_name: str | None
    config_path: Path | None
    reloads: Counter
    retiring: set[asyncio.Task[None]] = field(default_factory=set)
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


_LIVE = web.AppKey("fastroute_live", _Live)


def _build_context(
    config: Config,
    stats_block: StatsBlock | None,
    previous: ProxyContext | None,
    published_at: Callable[[], float | None] | None = None,
) -> ProxyContext:
    """A fresh request-path context; metrics and decisions carry over from ``previous``."""
    policies = build_policies(config)  # may raise PolicyConfigError: before any side effect
    fleet = Fleet(config, stats_block=stats_block)
    adm = config.admission
    admission = None
    if (
        previous is not None
        and previous.config.admission == adm
        and (
            previous.config.limits.max_concurrent_requests == config.limits.max_concurrent_requests
        )
    ):
        admission = previous.admission  # same limits: keep the slots held by old requests
    elif adm.enabled:
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
    if previous is not None:
        metrics, decisions = previous.metrics, previous.decisions
    else:
        metrics = ProxyMetrics(published_at or (lambda: fleet.state.published_at))
        decisions = DecisionLog()
    ctx = ProxyContext(
        config=config,
        fleet=fleet,
        policies=policies,
        budget=RetryBudget(
            ratio=config.retry.ratio,
            min_retries_per_s=config.retry.min_retries_per_s,
            ttl_s=config.retry.ttl_s,
            max_retries=config.retry.max_retries,
        ),
        admission=admission,
        decisions=decisions,
        metrics=metrics,
    )
    aggregator = getattr(previous, "aggregator", None)
    if aggregator is not None:
        ctx.aggregator = aggregator  # the signal path's counters outlive reloads
    return ctx


def _new_generation(ctx: ProxyContext, table_name: str) -> _Generation:
    def on_change(state: FleetState) -> None:
        ctx.metrics.table_generation.set(state.generation)

    watcher = TableWatcher(
        ctx.fleet, table_name, interval_s=TABLE_POLL_INTERVAL_S, on_change=on_change
    )
    return _Generation(ctx=ctx, handler=InferenceHandler(ctx), watcher=watcher)


def make_app(
    config: Config,
    *,
    table_name: str | None = None,
    stats_block: StatsBlock | None = None,
    config_path: str | Path | None = None,
) -> web.Application:
    """Build the proxy application for ``config``.

    Parameters
    ----------
    config : Config
        Validated configuration.
    table_name : str, optional
        Shared-memory weight table to follow; default ``config.proxy.table_name`` (of
        the config in force, after a reload too).
    stats_block : StatsBlock, optional
        The host's shared per-engine stats block (supervised workers). Without it,
        in-flight counts, totals and EWMAs are private to this process.
    config_path : str or Path, optional
        The file ``config`` came from; :func:`reload_config` re-reads it.

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
    live_ref: list[_Live] = []
    ctx = _build_context(
        config, stats_block, None, lambda: live_ref[0].current.ctx.fleet.state.published_at
    )
    app[CONTEXT] = ctx
    gen = _new_generation(ctx, table_name or config.proxy.table_name)
    reloads = Counter(
        "fastroute_proxy_config_reloads",
        "Config reloads (SIGHUP) by result: ok, or error (the old config stays).",
        ["result"],
        registry=ctx.metrics.registry,
    )
    app[_LIVE] = _Live(
        current=gen,
        stats_block=stats_block,
        table_name=table_name,
        config_path=Path(config_path) if config_path is not None else None,
        reloads=reloads,
    )
    live = app[_LIVE]
    live_ref.append(live)
    app.cleanup_ctx.append(_lifecycle)
    install_signal_tasks(
        app, ctx, config, table_name=table_name, current_context=lambda: current_context(app)
    )
    app.on_shutdown.append(_on_shutdown)
    app.on_response_prepare.append(_add_worker_header)

    def dispatch(kind: str) -> _Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            gen = live.current
            gen.active += 1
            try:
                handler: _Handler = getattr(gen.handler, kind)
                return await handler(request)
            finally:
                gen.active -= 1
                if gen.active == 0:
                    gen.idle.set()

        return handle

    app.router.add_post("/v1/chat/completions", dispatch("chat"))
    app.router.add_post("/v1/completions", dispatch("completions"))
    app.router.add_post("/v1/embeddings", dispatch("embeddings"))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/admin/decisions/{request_id}", _decision)
    return app


def current_context(app: web.Application) -> ProxyContext:
    """The context new requests use (``app[CONTEXT]`` is the first one, before reloads)."""
    return app[_LIVE].current.ctx


def _start_generation(gen: _Generation) -> None:
    gen.watcher.poll()  # adopt an existing table before serving with this generation
    gen.task = asyncio.create_task(gen.watcher.run(), name="fastroute-table-watcher")


async def _stop_generation(gen: _Generation, wait_s: float | None) -> None:
    """Stop the watcher, wait (bounded) for the generation's requests, close its pool."""
    if gen.task is not None:
        gen.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gen.task
    gen.watcher.close()
    if wait_s is not None and gen.active:
        gen.idle.clear()
        if gen.active:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(gen.idle.wait(), wait_s)
    if gen.ctx.upstream is not None:
        await gen.ctx.upstream.close()


async def reload_config(app: web.Application, config: Config | None = None) -> bool:
    """Swap in a new configuration for new requests, without touching the listener.

    Requests already being handled finish on the objects they started with (fleet,
    policies, upstream pool); their pool is closed once they are done (bounded by
    the old ``timeouts.total_timeout_s``). Metrics, decision records and the shared
    stats block carry over; the outlier detector and retry budget start fresh; the
    admission queue is kept when ``[admission]`` and ``limits`` did not change.

    Parameters
    ----------
    app : aiohttp.web.Application
        An app from :func:`make_app`, running.
    config : Config, optional
        The new configuration; default: re-read the app's ``config_path``.

    Returns
    -------
    bool
        True if the new config is in force; False if it was invalid (logged, counted
        in ``fastroute_proxy_config_reloads_total{result="error"}``, old config kept).
    """
    live = app[_LIVE]
    async with live.reload_lock:
        old = live.current
        try:
            if config is None:
                if live.config_path is None:
                    raise ConfigError("this proxy was not started from a config file")
                config = load_config(live.config_path)
            ctx = _build_context(config, live.stats_block, old.ctx)
        except (ConfigError, PolicyConfigError, OSError) as exc:
            live.reloads.labels("error").inc()
            logger.error("config reload failed, keeping the current config: %s", exc)
            return False
        _warn_restart_only(old.ctx.config, config)
        ctx.upstream = UpstreamPool(config)
        ctx.ready = True
        ctx.draining = old.ctx.draining
        gen = _new_generation(ctx, live.table_name or config.proxy.table_name)
        _start_generation(gen)
        live.current = gen
        old.retired = True
        wait_s = old.ctx.config.timeouts.total_timeout_s + 1.0
        task = asyncio.create_task(_stop_generation(old, wait_s), name="fastroute-retire")
        live.retiring.add(task)
        task.add_done_callback(live.retiring.discard)
        live.reloads.labels("ok").inc()
        logger.info(
            "config reloaded: %d engines, default policy %s",
            len(config.engines),
            config.policy.default,
        )
        return True


def _warn_restart_only(old: Config, new: Config) -> None:
    for field_name in ("host", "port", "workers", "stats_name"):
        if getattr(old.proxy, field_name) != getattr(new.proxy, field_name):
            logger.warning(
                "proxy.%s changed: takes effect only after a restart, not on reload", field_name
            )


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    live = app[_LIVE]
    gen = live.current
    gen.ctx.upstream = UpstreamPool(gen.ctx.config)
    _start_generation(gen)
    gen.ctx.ready = True
    try:
        yield
    finally:
        for task in list(live.retiring):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await _stop_generation(live.current, None)


async def _on_shutdown(app: web.Application) -> None:
    app[CONTEXT].draining = True
    app[_LIVE].current.ctx.draining = True


# The pid as a header value, formatted once per process (os.getpid() is a syscall).
_worker_pid = str(os.getpid())


def _reset_worker_pid() -> None:
    global _worker_pid
    _worker_pid = str(os.getpid())


os.register_at_fork(after_in_child=_reset_worker_pid)


async def _add_worker_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-fastroute-worker"] = _worker_pid


async def _models(request: web.Request) -> web.Response:
    config = current_context(request.app).config
    created = int(time.time())
    data = [
        {"id": m, "object": "model", "created": created, "owned_by": "fastroute"}
        for m in config.models()
    ]
    return web.json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    pid = os.getpid()
    if current_context(request.app).draining:
        return web.json_response({"status": "draining", "pid": pid}, status=503)
    return web.json_response({"status": "ok", "pid": pid})


async def _ready(request: web.Request) -> web.Response:
    ctx = current_context(request.app)
    state = ctx.fleet.state
    body = {"ready": ctx.ready, "weights": state.source, "generation": state.generation}
    return web.json_response(body, status=200 if ctx.ready and not ctx.draining else 503)


async def _metrics(request: web.Request) -> web.Response:
    ctx = current_context(request.app)
    ctx.metrics.table_generation.set(ctx.fleet.state.generation)
    return web.Response(
        body=ctx.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
    )


def _admin_allowed(request: web.Request) -> bool:
    token = current_context(request.app).config.proxy.admin_token
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
    record = current_context(request.app).decisions.get(rid)
    if record is None:
        return error_response(
            404,
            f"No decision record for request id {rid!r} (unknown or evicted).",
            code="decision_not_found",
        )
    return web.Response(body=record.to_json(), content_type="application/json")
