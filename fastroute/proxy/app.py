"""The proxy's application: routes, lifecycle, reload; served by two front ends.

``fastroute serve`` serves it with the lean HTTP/1.1 server of
:mod:`fastroute.proxy.server` (through :func:`dispatch`); in-process users (tests, the
controller's tests) may serve the aiohttp application :func:`make_app` returns with
``web.AppRunner`` + ``web.TCPSite``. Both run the same route functions and the same
request path; the aiohttp application also holds the lifecycle (``cleanup_ctx``:
upstream pool, weight-table watcher, signal tasks) for both.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from aiohttp import web
from prometheus_client import Counter

from fastroute.config import Config, ConfigError, load_config
from fastroute.policy import PolicyConfigError
from fastroute.proxy.admission import AdmissionQueue, QueueDelayGuard
from fastroute.proxy.decisions import DecisionLog
from fastroute.proxy.fleet import Fleet, FleetState
from fastroute.proxy.handler import (
    Incoming,
    InferenceHandler,
    ProxyContext,
    assign_request_id,
    build_policies,
    request_id_of,
)
from fastroute.proxy.marginal_setup import install_marginal
from fastroute.proxy.metrics import ProxyMetrics
from fastroute.proxy.openai_errors import error_reply, error_response
from fastroute.proxy.pd import PDPools
from fastroute.proxy.reply import Headers, Reply, Sink, raw_head_pairs
from fastroute.proxy.retry_budget import RetryBudget
from fastroute.proxy.signal_tasks import install_signal_tasks
from fastroute.proxy.table_watch import TableWatcher
from fastroute.proxy.upstream import UpstreamPool
from fastroute.tables.stats import StatsBlock

__all__ = [
    "make_app",
    "reload_config",
    "current_context",
    "dispatch",
    "begin_drain",
    "worker_pid",
    "CONTEXT",
    "TABLE_POLL_INTERVAL_S",
    "INFERENCE_PATHS",
]

logger = logging.getLogger(__name__)

#: The app's first :class:`~fastroute.proxy.handler.ProxyContext` (see
#: :func:`current_context` for the one in force after a reload).
CONTEXT = web.AppKey("fastroute_context", ProxyContext)

#: How often the background task checks the weight table's generation, seconds.
TABLE_POLL_INTERVAL_S = 0.5

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: The request path's endpoints (``POST`` only) and their handler kind.
INFERENCE_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
#: The ``GET`` endpoints (besides ``/admin/decisions/{request_id}``).
_GET_PATHS = ("/v1/models", "/health", "/ready", "/metrics")
_DECISIONS_PREFIX = "/admin/decisions/"


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
    if PDPools.needed(config):
        ctx.pd = PDPools(config, build_policies(config), build_policies(config), stats_block)
    aggregator = getattr(previous, "aggregator", None)
    if aggregator is not None:
        ctx.aggregator = aggregator  # the signal path's counters outlive reloads
    ctx.scraper = getattr(previous, "scraper", None)
    install_marginal(ctx, previous)
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

    def inference(kind: str) -> _Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            limit = live.current.ctx.config.limits.max_body_bytes
            body = await _read_body(request, limit)
            sink = _AiohttpSink(request)
            reply = await _infer(live, request, kind, body, sink, request_id_of(request))
            if reply.streamed:
                assert sink.response is not None
                return sink.response
            return _to_response(reply)

        return handle

    for path, kind in INFERENCE_PATHS.items():
        app.router.add_post(path, inference(kind))
    for path in _GET_PATHS:
        app.router.add_get(path, _aiohttp_get)
    app.router.add_get(_DECISIONS_PREFIX + "{request_id}", _aiohttp_get)
    return app


async def _infer(
    live: _Live, request: Incoming, kind: str, body: bytes | None, sink: Sink, rid: str
) -> Reply:
    """Run the request path of the generation in force, counted in its ``active``."""
    gen = live.current
    gen.active += 1
    try:
        return await gen.handler.handle(request, kind, body, sink, rid)
    finally:
        gen.active -= 1
        if gen.active == 0:
            gen.idle.set()


def dispatch(
    app: web.Application,
    method: str,
    path: str,
    request: Incoming,
    remote: str | None,
    body: bytes | None,
    sink: Sink,
    rid: str,
) -> Awaitable[Reply]:
    """Serve one request of the lean front end (:mod:`fastroute.proxy.server`).

    Not a coroutine itself but returns one: one coroutine layer less per request.

    Parameters
    ----------
    app : aiohttp.web.Application
        From :func:`make_app`, started (its ``cleanup_ctx`` ran).
    method, path : str
        Request method and path (without the query string).
    request : Incoming
        ``path`` and case-insensitive ``headers``.
    remote : str or None
        The client's address (admin routes are open to loopback).
    body : bytes or None
        The request body; None when it was over ``limits.max_body_bytes``.
    sink : Sink
        For streamed responses.
    rid : str
        The request id.

    Returns
    -------
    awaitable of Reply
        Every route's answer, OpenAI-shaped 404/405 included.
    """
    kind = INFERENCE_PATHS.get(path)
    if kind is not None:
        if method != "POST":
            return _done(_not_allowed(method, path, ("POST",)))
        return _infer(app[_LIVE], request, kind, body, sink, rid)
    if path in _GET_PATHS or path.startswith(_DECISIONS_PREFIX):
        if method not in ("GET", "HEAD"):
            return _done(_not_allowed(method, path, ("GET", "HEAD")))
        return _done(_get_reply(app, path, request.headers, remote))
    return _done(error_reply(404, f"Unknown request URL: {method} {path}.", code="unknown_url"))


async def _done(reply: Reply) -> Reply:
    return reply


def _not_allowed(method: str, path: str, allowed: tuple[str, ...]) -> Reply:
    return error_reply(
        405,
        f"Method {method} is not allowed on {path}; allowed: {', '.join(allowed)}.",
        code="method_not_allowed",
    )


async def _read_body(request: web.Request, limit: int) -> bytes | None:
    """The whole body, or None when it is over ``limit`` bytes."""
    length = request.content_length
    if length is not None and length > limit:
        return None
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return None


def _to_response(reply: Reply) -> web.Response:
    headers = raw_head_pairs(reply.raw_head) + reply.headers if reply.raw_head else reply.headers
    return web.Response(status=reply.status, body=reply.body, headers=headers)


class _AiohttpSink:
    """A :class:`~fastroute.proxy.reply.Sink` over aiohttp's ``StreamResponse``."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    async def start(self, status: int, headers: Headers, raw_head: bytes = b"") -> None:
        if raw_head:
            headers = raw_head_pairs(raw_head) + headers
        out = web.StreamResponse(status=status, headers=headers)
        out.headers["x-request-id"] = request_id_of(self.request)
        self.response = out
        await out.prepare(self.request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()

    def splice(self) -> None:
        return None  # aiohttp writes are coroutines: the handler relays chunk by chunk


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
    begin_drain(app)


def begin_drain(app: web.Application) -> None:
    """Mark the app draining: ``/health`` and ``/ready`` answer 503 from now on."""
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


def worker_pid() -> str:
    """This process's pid as the ``x-fastroute-worker`` header value."""
    return _worker_pid


async def _aiohttp_get(request: web.Request) -> web.Response:
    return _to_response(_get_reply(request.app, request.path, request.headers, request.remote))


def _json_reply(data: object, status: int = 200) -> Reply:
    return Reply(status, [("Content-Type", "application/json")], msgspec.json.encode(data))


def _get_reply(
    app: web.Application, path: str, headers: Mapping[str, str], remote: str | None
) -> Reply:
    """The ``GET`` routes: models, health, ready, metrics, decision records."""
    ctx = current_context(app)
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


def _admin_allowed(ctx: ProxyContext, headers: Mapping[str, str], remote: str | None) -> bool:
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
