"""The proxy application: lifecycle, config reloads and request dispatch, no HTTP server.

A :class:`ProxyApp` is built from a :class:`~fastroute.config.Config`; the lean
HTTP/1.1 server (:class:`fastroute.proxy.http.server.LeanServer`) parses requests, hands
them to :meth:`ProxyApp.dispatch` and writes the :class:`~fastroute.proxy.http.reply.Reply`
(routes: :mod:`fastroute.proxy.routes`). ``fastroute serve`` workers and the
in-process tests run exactly this pair.

aiohttp is no HTTP *server* of the proxy any more; it remains the HTTP *client* of
the signal path (weights puller, reporter, engine scraper, calibration pull), which
:meth:`ProxyApp.start` runs as background tasks.

Lifecycle: :meth:`ProxyApp.start` opens the upstream pool, judges the weight table found at
start (:class:`~fastroute.proxy.background.start_table.StartTable`: a table whose writer is gone
steers requests only if the start rule allows it), polls the table once (so ``/ready`` reflects
it) and then every :data:`TABLE_POLL_INTERVAL_S` in a background task, and starts the signal
tasks (the puller last: it takes the table's writer lock). :meth:`ProxyApp.stop` (after the server
drained) marks the app draining, stops the signal tasks, waits for retiring
generations and closes the pool.

Reload (:meth:`ProxyApp.reload`, on SIGHUP in ``fastroute serve`` workers): the
request path's objects are grouped in a *generation* (context, handler, table
watcher); a reload builds a new one and routes new requests to it, while requests
already running finish on theirs. :attr:`ProxyApp.context` is the context in force.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter

from fastroute._core.keylog_py import MAX_CHANNEL
from fastroute.config import Config, ConfigError
from fastroute.discovery.merge import load_effective_config
from fastroute.errors import TableError
from fastroute.guards.admission import QueueDelayGuard
from fastroute.guards.retry_budget import RetryBudget
from fastroute.policy import PolicyConfigError
from fastroute.policy.key_exchange import KeyExchange
from fastroute.proxy.admin_engines import FleetAdmin, is_admin_engines_path
from fastroute.proxy.background.signal_tasks import SignalTasks, install_signal_tasks
from fastroute.proxy.background.start_table import StartTable
from fastroute.proxy.background.table_watch import TableWatcher
from fastroute.proxy.http.reply import Reply, Sink
from fastroute.proxy.http.upstream import UpstreamPool
from fastroute.proxy.metrics import ProxyMetrics
from fastroute.proxy.path.admission import AdmissionQueue
from fastroute.proxy.path.decisions import DecisionLog
from fastroute.proxy.path.endpoint_handler import EndpointHandler
from fastroute.proxy.path.endpoints import endpoint_for
from fastroute.proxy.path.fleet import Fleet, FleetState
from fastroute.proxy.path.handler import Incoming, InferenceHandler, ProxyContext, build_policies
from fastroute.proxy.path.marginal_setup import install_marginal
from fastroute.proxy.path.pd import PDPools
from fastroute.proxy.path.stored_responses import is_stored_response_path
from fastroute.proxy.path.tenant_limits import TenantLimiter, proxy_id
from fastroute.proxy.routes import (
    INFERENCE_PATHS,
    get_reply,
    is_get_path,
    not_allowed,
    other_reply,
)
from fastroute.proxy.tracing import build_tracing
from fastroute.tables.key_log import KeyLogSegment, key_log_name
from fastroute.tables.response_map import ResponseMap, response_map_name
from fastroute.tables.stats import StatsBlock
from fastroute.tables.tenant_limits import MAX_TENANTS, TenantLimitBlock, tenant_block_name

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["ProxyApp", "ServedRequest", "build_context", "TABLE_POLL_INTERVAL_S"]

logger = logging.getLogger(__name__)

#: How often the background task checks the weight table's generation, seconds.
TABLE_POLL_INTERVAL_S = 0.5


class ServedRequest(Incoming, Protocol):
    """A parsed request as the front end hands it to :meth:`ProxyApp.dispatch`."""

    @property
    def method(self) -> str:
        """The request method."""

    @property
    def body(self) -> bytes | None:
        """The whole body; None when it was over ``limits.max_body_bytes``."""


@dataclass(eq=False)
class _Generation:
    """One config's request-path objects; in-flight requests finish on their own."""

    ctx: ProxyContext
    handler: InferenceHandler
    watcher: TableWatcher
    endpoints: EndpointHandler
    task: asyncio.Task[None] | None = None
    active: int = 0
    retired: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)


def build_context(
    config: Config,
    stats_block: StatsBlock | None,
    previous: ProxyContext | None,
    published_at: Callable[[], float | None] | None = None,
) -> ProxyContext:
    """A fresh request-path context; metrics and decisions carry over from ``previous``.

    Parameters
    ----------
    config : Config
    stats_block : StatsBlock or None
        The host's shared per-engine stats block.
    previous : ProxyContext or None
        The context being replaced (a reload); its metrics, decision log, signal
        aggregator, scraper and calibration are kept, and its admission queue when
        ``[admission]`` and ``limits`` did not change.
    published_at : callable, optional
        The weight table's publish time for the metrics of a first context; default
        this context's fleet's.

    Raises
    ------
    fastroute.policy.PolicyConfigError
        A configured policy is not implemented or has invalid parameters.
    """
    policies = build_policies(config)  # may raise PolicyConfigError: before any side effect
    fleet = Fleet(config, stats_block=stats_block)
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
        admission=_admission(config, previous),
        decisions=decisions,
        metrics=metrics,
    )
    if PDPools.needed(config):
        ctx.pd = PDPools(config, build_policies(config), build_policies(config), stats_block)
    aggregator = getattr(previous, "aggregator", None)
    if aggregator is not None:
        ctx.aggregator = aggregator  # the signal path's counters outlive reloads
    ctx.scraper = getattr(previous, "scraper", None)
    ctx.responses = _response_map(config, stats_block, previous)
    ctx.key_log = _share_key_log(ctx, stats_block, previous)
    ctx.models = getattr(previous, "models", None)
    ctx.tracer = _tracer(config, previous)
    ctx.tenants = _tenant_limiter(config, stats_block, ctx, previous)
    install_marginal(ctx, previous)
    return ctx


def _tenant_limiter(
    config: Config,
    stats_block: StatsBlock | None,
    ctx: ProxyContext,
    previous: ProxyContext | None,
) -> TenantLimiter | None:
    """Tenant limits over the host's shared counters (``{stats_name}.tenants``, created by
    the supervisor); a private block when there is none (one worker, or a lone test).
    A reload keeps the previous context's block (its counts and in-flight units)."""
    if not config.tenants:
        return None
    n = min(len(config.tenants), MAX_TENANTS)
    block: TenantLimitBlock | None = None
    old = previous.tenants if previous is not None else None
    if old is not None and old.block.n_tenants >= n:
        block = old.block
    elif stats_block is not None:
        try:
            block = TenantLimitBlock.attach(tenant_block_name(stats_block.name))
        except (TableError, OSError) as exc:
            logger.warning("no shared tenant counters (%s): tenant limits are per worker", exc)
    if block is None or block.n_tenants < n:
        block = TenantLimitBlock.private(n)
    return TenantLimiter(config, block, proxy_id(config), ctx.metrics)


def _share_key_log(
    ctx: ProxyContext, stats_block: StatsBlock | None, previous: ProxyContext | None
) -> KeyLogSegment | None:
    """Give every policy instance of ``ctx`` the host's key log (``{stats_name}.keys``,
    created by the supervisor; the previous context's on a reload), one channel per
    instance in a fixed order so that the workers' instances of one policy meet on one
    channel, and ``ctx.key_exchange`` its end of the peers' exchange (the channels'
    labels); None without a log (``proxy.key_log_entries = 0``, or no supervisor)."""
    segment = previous.key_log if previous is not None else None
    if not ctx.config.proxy.key_log_entries:
        segment = None  # switched off by a reload: the old mapping goes with the old context
    elif segment is None and stats_block is not None:
        try:
            segment = KeyLogSegment.attach(key_log_name(stats_block.name))
        except (TableError, OSError) as exc:
            logger.warning("no shared key log (%s): prefix tables are per worker", exc)
    logs = []
    if segment is not None:
        instances = [(f"proxy:{name}", policy) for name, policy in ctx.policies.items()]
        if ctx.pd is not None:
            instances += [(f"prefill:{n}", p) for n, p in ctx.pd.prefill_policies.items()]
            instances += [(f"decode:{n}", p) for n, p in ctx.pd.decode_policies.items()]
        instances = instances[: MAX_CHANNEL + 1]
        for channel, (_, policy) in enumerate(instances):
            log = policy.attach_key_log(segment.buffer, secrets.randbits(32), channel, segment.fd)
            if log is not None:
                logs.append(log)
        labels = [label for label, _ in instances]
        ctx.key_exchange = KeyExchange(segment.buffer, labels, segment.fd)
    ctx.metrics.use_key_logs(logs)
    return segment


def _response_map(
    config: Config, stats_block: StatsBlock | None, previous: ProxyContext | None
) -> ResponseMap | None:
    """The previous context's id map; else the host's, next to its stats block (the
    supervisor creates it); None: the handler makes a private one."""
    if previous is not None and previous.responses is not None:
        return previous.responses
    if stats_block is None:
        return None
    try:
        return ResponseMap.attach(response_map_name(stats_block.name))
    except (TableError, OSError) as exc:
        logger.warning(
            "no shared response map (%s): previous_response_id affinity is per worker", exc
        )
        return ResponseMap.private(config.proxy.response_map_capacity)


def _tracer(config: Config, previous: ProxyContext | None) -> Any:
    """The previous context's tracer when ``[tracing]`` did not change, else a new one
    (the old one is shut down on a thread: its last export must not block the loop)."""
    if previous is not None:
        if previous.config.tracing == config.tracing:
            return previous.tracer
        threading.Thread(target=previous.tracer.shutdown, daemon=True).start()
    return build_tracing(config.tracing)


def _admission(config: Config, previous: ProxyContext | None) -> AdmissionQueue | None:
    adm = config.admission
    if (
        previous is not None
        and previous.config.admission == adm
        and (
            previous.config.limits.max_concurrent_requests == config.limits.max_concurrent_requests
        )
    ):
        return previous.admission  # same limits: keep the slots held by old requests
    if not adm.enabled:
        return None
    guard_kwargs: dict[str, float | int] = {
        "max_queue_len": adm.max_queue_len,
        "interval_s": adm.interval_s,
        "max_wait_s": adm.max_wait_s,
        "retry_after_s": float(adm.retry_after_s),
    }
    if adm.target_sojourn_s is not None:
        guard_kwargs["target_s"] = adm.target_sojourn_s
    guard = QueueDelayGuard(config.limits.max_concurrent_requests, **guard_kwargs)  # type: ignore[arg-type]
    return AdmissionQueue(guard)


def _new_generation(ctx: ProxyContext, table_name: str, start: StartTable) -> _Generation:
    def on_change(state: FleetState) -> None:
        ctx.metrics.table_generation.set(state.generation)

    watcher = TableWatcher(
        ctx.fleet,
        table_name,
        interval_s=TABLE_POLL_INTERVAL_S,
        on_change=on_change,
        start=start if start.name == table_name else None,
    )
    return _Generation(
        ctx=ctx, handler=InferenceHandler(ctx), watcher=watcher, endpoints=EndpointHandler(ctx)
    )


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


async def _done(reply: Reply) -> Reply:
    return reply


class ProxyApp:
    """The proxy's request path, background tasks and reloads behind one object.

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
        The file ``config`` came from; :meth:`reload` without a config re-reads it
        (with its engines state file, :func:`fastroute.discovery.merge.load_effective_config`),
        and the fleet admin API (:mod:`fastroute.proxy.admin_engines`) writes next to it.
    span_exporter : SpanExporter, optional
        With ``tracing.enabled``: where the request path's spans go instead of
        ``tracing.otlp_endpoint`` (tests pass the SDK's ``InMemorySpanExporter``).

    Attributes
    ----------
    signals : SignalTasks
        The signal-path components (puller, reporter, scraper, calibration pull).
    fleet_admin : FleetAdmin
        The fleet admin API; its ``apply`` (default: reload this app) is what a change
        triggers (``fastroute serve`` workers signal their supervisor instead).
    start_table : StartTable
        The start rule's verdict on the weight table found at start (``/ready``'s
        ``stale_table``); judged in :meth:`start`.

    Raises
    ------
    fastroute.policy.PolicyConfigError
        A configured policy is not implemented or has invalid parameters.

    Notes
    -----
    Use as ``async with ProxyApp(config) as app:`` or call :meth:`start` and
    :meth:`stop`; requests are dispatched only in between.
    """

    def __init__(
        self,
        config: Config,
        *,
        table_name: str | None = None,
        stats_block: StatsBlock | None = None,
        config_path: str | Path | None = None,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        ctx = build_context(
            config, stats_block, None, lambda: self._current.ctx.fleet.state.published_at
        )
        if span_exporter is not None and config.tracing.enabled:  # tests: in-memory spans
            ctx.tracer.shutdown()
            ctx.tracer = build_tracing(config.tracing, span_exporter)
        name = table_name or config.proxy.table_name
        # judged in start(); kept across reloads (a reload must not adopt a held table)
        self.start_table = StartTable(
            name,
            max_age_s=config.proxy.stale_table_max_age_s,
            pulls=config.proxy.controller_url is not None,
        )
        self._current = _new_generation(ctx, name, self.start_table)
        self._stats_block = stats_block
        self._table_name = table_name
        self._config_path = Path(config_path) if config_path is not None else None
        self._reloads = Counter(
            "fastroute_proxy_config_reloads",
            "Config reloads (SIGHUP) by result: ok, or error (the old config stays).",
            ["result"],
            registry=ctx.metrics.registry,
        )
        self._retiring: set[asyncio.Task[None]] = set()
        self._retired: set[_Generation] = set()  # retired, requests still running
        self._fleet_reloads: set[asyncio.Task[bool]] = set()
        self._reload_lock = asyncio.Lock()
        self._stopped = False
        self.signals: SignalTasks = install_signal_tasks(
            ctx, config, table_name=table_name, current_context=lambda: self.context
        )
        self.fleet_admin = FleetAdmin(self._config_path, lambda: self.context, self._reload_soon)

    @property
    def context(self) -> ProxyContext:
        """The context new requests use (the latest reload's)."""
        return self._current.ctx

    async def start(self) -> None:
        """Open the upstream pool, adopt the weight table, start the background tasks."""
        gen = self._current
        gen.ctx.upstream = UpstreamPool(gen.ctx.config)
        self.start_table.judge()  # before this worker's puller can take the writer lock
        _start_generation(gen)
        gen.ctx.ready = True
        self.signals.start()

    async def stop(self) -> None:
        """Mark draining, stop the background tasks, close every generation's pool.

        Call after the front end stopped serving (requests still running on the
        current generation are not waited for). Idempotent.
        """
        if self._stopped:
            return
        self._stopped = True
        self.begin_drain()
        await self.signals.stop()
        for task in list(self._retiring):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await _stop_generation(self._current, None)
        tracer = self._current.ctx.tracer
        if tracer.enabled:  # flushes the last spans: on a thread, not the loop
            await asyncio.get_running_loop().run_in_executor(None, tracer.shutdown)

    async def __aenter__(self) -> ProxyApp:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def begin_drain(self) -> None:
        """Mark the app draining: ``/health`` and ``/ready`` answer 503 from now on."""
        self._current.ctx.draining = True

    def dispatch(
        self, request: ServedRequest, remote: str | None, sink: Sink, rid: str
    ) -> Awaitable[Reply]:
        """Serve one request: every route's answer, OpenAI-shaped 404/405 included.

        Not a coroutine itself but returns one: one coroutine layer less per request.

        Parameters
        ----------
        request : ServedRequest
            Method, path (without the query string), headers and body.
        remote : str or None
            The client's address (admin routes are open to loopback).
        sink : Sink
            For streamed responses.
        rid : str
            The request id.
        """
        method, path = request.method, request.path
        kind = INFERENCE_PATHS.get(path)
        if kind is not None:
            if method != "POST":
                return _done(not_allowed(method, path, ("POST",)))
            return self._infer(request, kind, sink, rid)
        if is_admin_engines_path(path):
            return self.fleet_admin.reply(method, path, request.body, request.headers, remote)
        if is_get_path(path):
            if method not in ("GET", "HEAD"):
                return _done(not_allowed(method, path, ("GET", "HEAD")))
            return _done(
                get_reply(self._current.ctx, path, request.headers, remote, self.start_table)
            )
        if is_stored_response_path(path):
            return self._stored(request, method, rid)
        return self._other(request, remote, sink, rid)

    def _other(
        self, request: ServedRequest, remote: str | None, sink: Sink, rid: str
    ) -> Awaitable[Reply]:
        """The engine endpoints and pass-through paths (``POST``), else the routes the
        proxy answers itself (``/ping``...) or 404."""
        method, path = request.method, request.path
        ctx = self._current.ctx
        endpoint = endpoint_for(path, ctx.config)
        if endpoint is not None:
            if method != "POST":
                return _done(not_allowed(method, path, ("POST",)))
            return self._infer_endpoint(request, endpoint.kind, sink, rid)
        return _done(other_reply(ctx, method, path))

    async def _infer(self, request: ServedRequest, kind: str, sink: Sink, rid: str) -> Reply:
        """Run the request path of the generation in force, counted in its ``active``."""
        gen = self._current
        gen.active += 1
        try:
            return await gen.handler.handle(request, kind, request.body, sink, rid)
        finally:
            gen.active -= 1
            if gen.active == 0:
                gen.idle.set()

    async def _infer_endpoint(
        self, request: ServedRequest, kind: str, sink: Sink, rid: str
    ) -> Reply:
        """:meth:`_infer` for the engine endpoints (their own handler)."""
        gen = self._current
        gen.active += 1
        try:
            return await gen.endpoints.handle(request, kind, request.body, sink, rid)
        finally:
            gen.active -= 1
            if gen.active == 0:
                gen.idle.set()

    async def _stored(self, request: ServedRequest, method: str, rid: str) -> Reply:
        """A stored-response route on the generation in force, counted in its ``active``."""
        gen = self._current
        gen.active += 1
        try:
            return await gen.handler.stored.serve(request, method, rid)
        finally:
            gen.active -= 1
            if gen.active == 0:
                gen.idle.set()

    async def reload(self, config: Config | None = None) -> bool:
        """Swap in a new configuration for new requests, without touching the listener.

        Requests already being handled finish on the objects they started with (fleet,
        policies, upstream pool); their pool is closed once they are done (bounded by
        the old ``timeouts.total_timeout_s``). Metrics, decision records and the shared
        stats block carry over; the outlier detector and retry budget start fresh; the
        admission queue is kept when ``[admission]`` and ``limits`` did not change.

        Parameters
        ----------
        config : Config, optional
            The new configuration; default: re-read the app's ``config_path`` merged with
            its engines state file (admin API and discovered engines).

        Returns
        -------
        bool
            True if the new config is in force; False if it was invalid (logged, counted
            in ``fastroute_proxy_config_reloads_total{result="error"}``, old config kept).
        """
        async with self._reload_lock:
            old = self._current
            try:
                if config is None:
                    if self._config_path is None:
                        raise ConfigError("this proxy was not started from a config file")
                    config = load_effective_config(self._config_path)
                if self._stats_block is not None:
                    self._stats_block.refresh()  # slots the supervisor gave new engines
                ctx = build_context(config, self._stats_block, old.ctx)
            except (ConfigError, PolicyConfigError, OSError) as exc:
                self._reloads.labels("error").inc()
                logger.error("config reload failed, keeping the current config: %s", exc)
                return False
            _warn_restart_only(old.ctx.config, config)
            ctx.upstream = UpstreamPool(config)
            ctx.ready = True
            ctx.draining = old.ctx.draining
            gen = _new_generation(
                ctx, self._table_name or config.proxy.table_name, self.start_table
            )
            _start_generation(gen)
            self._current = gen
            self._retire(old)
            in_force = {e.name for e in config.engines}
            for retired in self._retired:  # their streams on engines gone hand off
                retired.ctx.fleet.leaving(in_force)
            self._reloads.labels("ok").inc()
            logger.info(
                "config reloaded: %d engines, default policy %s",
                len(config.engines),
                config.policy.default,
            )
            return True

    def _reload_soon(self) -> None:
        """Reload from the files in the background (a fleet admin change, no supervisor)."""
        task = asyncio.create_task(self.reload(), name="fastroute-fleet-reload")
        self._fleet_reloads.add(task)
        task.add_done_callback(self._fleet_reloads.discard)

    def _retire(self, old: _Generation) -> None:
        """Close ``old`` in the background once its requests are done (bounded)."""
        old.retired = True
        wait_s = old.ctx.config.timeouts.total_timeout_s + 1.0
        task = asyncio.create_task(_stop_generation(old, wait_s), name="fastroute-retire")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        self._retired.add(old)
        task.add_done_callback(lambda _: self._retired.discard(old))


def _warn_restart_only(old: Config, new: Config) -> None:
    for field_name in ("host", "port", "workers", "stats_name", "max_engines"):
        if getattr(old.proxy, field_name) != getattr(new.proxy, field_name):
            logger.warning(
                "proxy.%s changed: takes effect only after a restart, not on reload", field_name
            )
