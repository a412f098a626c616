"""The controller's HTTP API (aiohttp), around one :class:`controller.service.ControllerService`.

Endpoints (docs/controller.md "Service", docs/signals.md §4):

* ``GET /v1/table?after=G&timeout_s=T[&format=json|msgpack][&cluster=NAME]`` — long-poll: 200
  at once with the current snapshot when its generation differs from ``G`` (header
  ``x-fastroute-generation``), else wait for a new one up to ``min(T,
  controller.long_poll_timeout_s)`` and answer 304. The encoding is ``format``, else the
  ``Accept`` header, else msgpack. With ``cluster`` (a proxy's ``proxy.cluster``), only that
  region's rows over the engines they weight or that are flagged
  (:func:`controller.region_tables.region_snapshot`; same generation, publish time and meta);
  404 naming the declared regions for an unknown one. Each (generation, cluster, format) is
  encoded once. At most ``max_waiters`` polls may be parked at once; more get 503 with
  ``Retry-After: 1``.
* ``POST /v1/reports`` — a msgpack :class:`fastroute.signals.reports.Report`; 204 when accepted,
  400 (text message) when malformed or of another version, 413 above ``max_report_bytes``.
* ``GET /v1/calibration[?format=json|msgpack]`` — the fleet's step-time calibration as the
  proxies reported it (:class:`controller.calibration.CalibrationBoard`: per engine type the
  most-sampled worker's state), a :class:`fastroute.predict.CalibrationSnapshot`; new proxy
  workers load it. 404 before any worker reported a calibrated type.
* ``GET /v1/plan`` — JSON: per class demand, allocation and weights per engine, shed fraction,
  marginal cost (dual); solve status, objective, time, iterations; per engine capacity and load.
* ``GET /plan`` — the same plan as a self-contained HTML page (:mod:`controller.plan_page`).
* ``GET /health`` — 200 once a table has been published (the last good one stays published when
  later periods fail), 503 before; the body also names the last failed config reload, if any.
* ``GET /metrics`` — Prometheus text from the app's own registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

import msgspec
import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controller.ha import RELAYED_HEADER
from controller.metrics import ControllerMetrics
from controller.options import ControllerOptions
from controller.plan_page import render_plan_html
from controller.region_tables import EncodedTables, UnknownClusterError
from controller.service import ControllerService
from fastroute.config import Config
from fastroute.signals.reports import ReportError, decode_report
from fastroute.tables import TableSnapshot

__all__ = ["API", "SERVICE", "ControllerApi", "make_app"]

log = logging.getLogger(__name__)

SERVICE = web.AppKey("controller_service", ControllerService)

#: Default bound on parked long-polls.
MAX_WAITERS = 1024
#: Default size limit of one report (a 4096-class, 8192-engine report is well below it).
MAX_REPORT_BYTES = 4 * 1024 * 1024
MSGPACK = "application/msgpack"
JSON = "application/json"


class ControllerApi:
    """The request handlers; ``waiters`` is the number of parked long-polls."""

    def __init__(self, service: ControllerService, max_waiters: int) -> None:
        self.service = service
        self.max_waiters = max_waiters
        self.waiters = 0
        #: Wire encodings of the table in force, full and per region.
        self.tables = EncodedTables()

    def _encode(self, fmt: str, cluster: str | None) -> bytes:
        """The table in force (``cluster`` None) or a region's block; UnknownClusterError."""
        svc = self.service
        snap = svc.snapshot
        assert snap is not None
        return self.tables.encoded(
            snap,
            fmt,
            cluster,
            row_clusters=svc.publisher.row_clusters,
            declared=[r.name for r in svc.config.network.regions],
        )

    async def table(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        try:
            after = int(q.get("after", "0"))
            cap_s = self.service.config.controller.long_poll_timeout_s
            timeout_s = min(float(q.get("timeout_s", str(cap_s))), cap_s)
            if after < 0 or not timeout_s >= 0:
                raise ValueError("after and timeout_s must be >= 0")
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"bad query: {exc}") from None
        fmt = _format(request)
        cluster = q.get("cluster")
        svc = self.service
        if svc.ha is not None and not svc.ha.leading():
            raise _to_leader(svc.ha.state_json(), request)
        if cluster is not None:
            _check_cluster(cluster, svc)  # before parking: a typo must not wait out a poll
        if _same_table(svc.snapshot, after, q.get("epoch")):
            if self.waiters >= self.max_waiters:
                raise web.HTTPServiceUnavailable(
                    text=f"too many parked long-polls ({self.max_waiters})",
                    headers={"Retry-After": "1"},
                )
            self.waiters += 1
            try:
                snap = await svc.publisher.wait_changed(after, timeout_s, q.get("epoch"))
            finally:
                self.waiters -= 1
            if snap is None:
                return web.Response(status=304)
        snap = svc.snapshot
        assert snap is not None
        try:
            body = self._encode(fmt, cluster)
        except UnknownClusterError as exc:  # declared by the config, gone after a reload
            raise web.HTTPNotFound(text=str(exc)) from None
        return web.Response(
            body=body,
            content_type=JSON if fmt == "json" else MSGPACK,
            headers={"x-fastroute-generation": str(snap.generation)},
        )

    async def reports(self, request: web.Request) -> web.Response:
        metrics = self.service.metrics
        try:
            data = await request.read()
        except web.HTTPRequestEntityTooLarge:
            metrics.reports.labels(outcome="rejected").inc()
            raise
        try:
            report = decode_report(data)
        except ReportError as exc:
            metrics.reports.labels(outcome="rejected").inc()
            raise web.HTTPBadRequest(text=f"bad report: {exc}") from None
        self.service.observe(report)
        metrics.reports.labels(outcome="accepted").inc()
        ha = self.service.ha
        if ha is not None and RELAYED_HEADER not in request.headers:
            ha.relay_report(data)  # the leader sees every proxy's demand
        return web.Response(status=204)

    async def calibration(self, request: web.Request) -> web.Response:
        snap = self.service.calibration.published()
        if snap is None:
            raise web.HTTPNotFound(text="no calibration reported yet")
        fmt = _format(request)
        if fmt == "json":
            return web.Response(body=msgspec.json.encode(snap), content_type=JSON)
        return web.Response(body=msgspec.msgpack.encode(snap), content_type=MSGPACK)

    async def plan(self, request: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps(self.service.plan_json(), default=_json_default),
            content_type=JSON,
        )

    async def plan_page(self, request: web.Request) -> web.Response:
        page = render_plan_html(self.service.plan_json(), now=time.time())
        return web.Response(text=page, content_type="text/html", charset="utf-8")

    async def health(self, request: web.Request) -> web.Response:
        svc = self.service
        ok = svc.snapshot is not None
        body: dict[str, object] = {
            "status": "ok" if ok else "starting",
            "generation": svc.generation,
            "last_error": svc.last_error,
            "last_reload_error": svc.last_reload_error,
        }
        if svc.ha is not None:
            body.update(svc.ha.state_json())
            # a follower that knows its leader is a healthy standby
            ok = (ok and svc.ha.leading()) or body["role"] == "follower"
            body["status"] = "ok" if ok else body["role"]
        return web.json_response(body, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        svc = self.service
        if svc.ha is None:
            svc.metrics.leader.set(1.0)
            svc.metrics.epoch.set(-1.0)
        else:
            epoch = svc.ha.state_json()["epoch"]
            svc.metrics.leader.set(1.0 if svc.ha.leading() else 0.0)
            svc.metrics.epoch.set(-1.0 if epoch is None else float(epoch))
        body = generate_latest(self.service.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


API = web.AppKey("controller_api", ControllerApi)


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _same_table(snap: TableSnapshot | None, after: int, epoch: str | None) -> bool:
    """Whether the poller already has the table in force (so the poll parks): same generation,
    and, when it names one, same epoch (a new leader's generations restart low)."""
    if snap is None:
        return True
    if snap.generation != after:
        return False
    return epoch is None or str(snap.meta.get("epoch")) == epoch


def _check_cluster(cluster: str, svc: ControllerService) -> None:
    """404 unless ``cluster`` is a region of the config or of the table in force."""
    declared = {r.name for r in svc.config.network.regions}
    if cluster not in declared and cluster not in svc.publisher.row_clusters:
        exc = UnknownClusterError(cluster, declared | set(svc.publisher.row_clusters))
        raise web.HTTPNotFound(text=str(exc))


def _to_leader(state: dict[str, object], request: web.Request) -> web.HTTPException:
    """307 to the leader's ``/v1/table`` (same query) when known, else 503 naming the state."""
    leader = state.get("leader")
    if isinstance(leader, str):
        return web.HTTPTemporaryRedirect(
            location=leader.rstrip("/") + request.path_qs,
            headers={"x-fastroute-leader": leader},
        )
    return web.HTTPServiceUnavailable(
        text=f"not the leader and no leader known (role {state.get('role')})",
        headers={"Retry-After": "1"},
    )


def _format(request: web.Request) -> str:
    """``json`` or ``msgpack``: the ``format`` query, else the ``Accept`` header."""
    fmt = request.query.get("format")
    if fmt is None:
        fmt = "json" if JSON in request.headers.get("Accept", "") else "msgpack"
    if fmt not in ("json", "msgpack"):
        raise web.HTTPBadRequest(text=f"format must be json or msgpack, got {fmt!r}")
    return fmt


def make_app(
    config: Config,
    options: ControllerOptions | None = None,
    *,
    max_waiters: int = MAX_WAITERS,
    max_report_bytes: int = MAX_REPORT_BYTES,
    run_loop: bool = True,
) -> web.Application:
    """Build the controller app; the control loop runs while the app does.

    Parameters
    ----------
    config : Config
    options : ControllerOptions, optional
        The service's table name, mode (``"lp"`` or the ``"p-controller"`` baseline) and
        tunables (default ``ControllerOptions()``).
    max_waiters : int
        Parked long-polls allowed at once; more get 503.
    max_report_bytes : int
        Largest accepted report body; larger ones get 413.
    run_loop : bool
        Start the periodic control loop (tests may drive :meth:`ControllerService.step`).

    Notes
    -----
    Startup opens the table (``TableLockedError`` if another writer owns it) and publishes a first
    plan from the default demand before serving; with ``run_loop`` the engine scrapes
    (:class:`controller.scrape.EngineScraper`) run every ``controller.scrape_interval_s``.
    Cleanup lets a running period finish, then closes the table without unlinking it: proxies on
    this host keep routing on the last weights, and a restarted controller continues its
    generations in place.
    """
    service = ControllerService(config, options, metrics=ControllerMetrics())
    api = ControllerApi(service, max_waiters)
    app = web.Application(client_max_size=max_report_bytes)
    app[SERVICE] = service
    app[API] = api
    app.router.add_get("/v1/table", api.table)
    app.router.add_post("/v1/reports", api.reports)
    app.router.add_get("/v1/calibration", api.calibration)
    app.router.add_get("/v1/plan", api.plan)
    app.router.add_get("/plan", api.plan_page)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        service.open()
        task: asyncio.Task[None] | None = None
        try:
            if run_loop:
                # the service owns the scrape task: a config reload may replace the scraper
                service.start_scrapes()
                task = asyncio.create_task(service.run(), name="controller-loop")
            else:
                await service.step()
            yield
        finally:
            service.stop()
            await service.stop_scrapes()
            if task is not None:
                limit_s = service.config.controller.solve_time_limit_s + 5.0
                try:
                    await asyncio.wait_for(asyncio.shield(task), limit_s)
                except TimeoutError:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await service.aclose()

    app.cleanup_ctx.append(lifecycle)
    return app
