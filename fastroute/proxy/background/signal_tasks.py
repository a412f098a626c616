"""Wire the signal-path background tasks into the proxy app (docs/design.md §4, §5).

:func:`install_signal_tasks` is called once by
:class:`~fastroute.proxy.proxy_app.ProxyApp`, which starts and stops the returned
:class:`SignalTasks` with itself. Depending on the config they are:

* ``proxy.controller_url`` set: a :class:`~fastroute.proxy.background.reporter.Reporter`
  (per-window demand and engine reports, every ``proxy.report_interval_s``), whose
  :class:`~fastroute.signals.reports.DemandAggregator` becomes
  ``ctx.aggregator`` so the request path feeds it; and a
  :class:`~fastroute.proxy.background.puller.WeightsPuller` writing the controller's tables
  into ``proxy.table_name`` (one per host: the writer lock decides);
* ``proxy.scrape_engines``: an :class:`~fastroute.proxy.background.scraper.EngineScraper`;
* ``proxy.peers``: a :class:`~fastroute.proxy.background.peer_queues.PeerQueues` (the other
  proxies' queued prompt tokens, every ``proxy.peer_poll_interval_s``; its metrics are
  listed there);
* always: a :class:`~fastroute.proxy.background.models_scrape.ModelsScraper` (every engine's
  ``GET /v1/models`` every ``proxy.models_scrape_interval_s``), whose
  :class:`~fastroute.proxy.background.models_scrape.ModelCatalog` becomes ``ctx.models``
  (``GET /v1/models`` and ``/ready`` read it).

Their counters are exported on the app's ``/metrics`` (read at scrape time):

=================================================  =======  ==============================
``fastroute_proxy_weights_pulls_total``            counter  long-polls made
``fastroute_proxy_weights_updates_total``          counter  tables published locally
``fastroute_proxy_weights_pull_errors_total``      counter  kind
``fastroute_proxy_tables_fenced_total``            counter  tables of an older epoch refused
``fastroute_proxy_weights_controller_epoch``       gauge    epoch in force (-1: none)
``fastroute_proxy_weights_controller_generation``  gauge    controller generation applied
``fastroute_proxy_weights_puller_active``          gauge    1: this worker holds the lock
``fastroute_proxy_reports_total``                  counter  outcome (sent, failed)
``fastroute_proxy_engine_scrapes_total``           counter  engine
``fastroute_proxy_engine_scrape_errors_total``     counter  engine
``fastroute_proxy_engine_scrape_age_seconds``      gauge    engine (NaN: never scraped)
``fastroute_proxy_engine_requests_running``        gauge    engine
``fastroute_proxy_engine_requests_waiting``        gauge    engine
``fastroute_proxy_engine_kv_cache_usage``          gauge    engine (fraction)
``fastroute_proxy_engine_prefix_cache_hit_ratio``  gauge    engine (hits / queried tokens)
``fastroute_proxy_engine_prefix_cache_queried_tokens``  gauge  engine (in the window)
``fastroute_proxy_engine_prefix_cache_window_seconds``  gauge  engine (NaN: since start)
``fastroute_proxy_prefix_cache_hit_ratio``         gauge    fleet, token-weighted
=================================================  =======  ==============================

The prefix-cache families are the engines' own counters windowed over the last minute
(:mod:`fastroute.signals.prefix_cache`): the ratio is absent while it is unknown (no prefix-cache
metric) or without traffic (``queried_tokens`` 0 says which); an engine reporting only a rate
gauge (SGLang without counters) has the ratio and no ``queried_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fastroute.config import Config
from fastroute.predict import FleetCalibration
from fastroute.proxy.background.calibration_pull import CalibrationPull
from fastroute.proxy.background.leader_lookup import EtcdLeader
from fastroute.proxy.background.models_scrape import ModelCatalog, ModelsScraper
from fastroute.proxy.background.peer_queues import PeerQueues, PeerQueuesCollector
from fastroute.proxy.background.puller import WeightsPuller
from fastroute.proxy.background.reporter import Reporter
from fastroute.proxy.background.scraper import EngineScraper
from fastroute.proxy.path.handler import ProxyContext
from fastroute.proxy.path.marginal_setup import attach_scraper
from fastroute.proxy.path.tenant_limits import proxy_id
from fastroute.signals.prefix_cache import fleet_hit_rate
from fastroute.signals.reports import DemandAggregator

__all__ = ["STALE_SCRAPE_INTERVALS", "SignalTasks", "install_signal_tasks"]

#: An engine whose last good scrape is older than this many scrape intervals is stale: its
#: prefix-cache window is left off ``/metrics`` (as the controller's ``stale_after_s`` default).
STALE_SCRAPE_INTERVALS = 3.0


@dataclass
class SignalTasks:
    """The signal-path components of one app (each None when not configured)."""

    aggregator: DemandAggregator | None = None
    reporter: Reporter | None = None
    puller: WeightsPuller | None = None
    scraper: EngineScraper | None = None
    calibration: CalibrationPull | None = None
    models: ModelsScraper | None = None
    peers: PeerQueues | None = None
    _running: list[asyncio.Task[None]] = field(default_factory=list, repr=False)

    def start(self) -> None:
        """Run every configured component as a background task (needs a running loop)."""
        for name, component in (
            ("puller", self.puller),
            ("reporter", self.reporter),
            ("scraper", self.scraper),
            ("calibration", self.calibration),
            ("models-scrape", self.models),
            ("peer-queues", self.peers),
        ):
            if component is not None:
                task = asyncio.create_task(component.run(), name=f"fastroute-{name}")
                self._running.append(task)

    async def stop(self) -> None:
        """Cancel the background tasks and wait for them to end."""
        running, self._running = self._running, []
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(asyncio.CancelledError):
                await task


class _SignalCollector(Collector):
    def __init__(self, tasks: SignalTasks) -> None:
        self.tasks = tasks

    def collect(self) -> Iterator[Metric]:
        puller, reporter, scraper = self.tasks.puller, self.tasks.reporter, self.tasks.scraper
        pull = self.tasks.calibration
        if pull is not None:
            family = GaugeMetricFamily(
                "fastroute_proxy_calibration_start",
                "1 for how the worker's calibration started: loaded from the controller, "
                "not_needed, none_published, failed or pending.",
                labels=["outcome"],
            )
            family.add_metric([pull.outcome], 1.0)
            yield family
        if puller is not None:
            yield CounterMetricFamily(
                "fastroute_proxy_weights_pulls", "Long-polls of the controller's table.",
                value=puller.polls_total,
            )  # fmt: skip
            yield CounterMetricFamily(
                "fastroute_proxy_weights_updates", "Controller tables published locally.",
                value=puller.updates_total,
            )  # fmt: skip
            yield CounterMetricFamily(
                "fastroute_proxy_tables_fenced",
                "Controller tables refused: their epoch is older than the one in force.",
                value=puller.fenced_total,
            )
            yield GaugeMetricFamily(
                "fastroute_proxy_weights_controller_epoch",
                "Controller epoch of the table in force (-1: none carried one).",
                value=-1 if puller.epoch is None else puller.epoch,
            )
            errors = CounterMetricFamily(
                "fastroute_proxy_weights_pull_errors", "Failed polls by kind.", labels=["kind"]
            )
            for kind, n in sorted(puller.errors_total.items()):
                errors.add_metric([kind], n)
            yield errors
            yield GaugeMetricFamily(
                "fastroute_proxy_weights_controller_generation",
                "Controller table generation last applied (0: none).",
                value=puller.controller_generation,
            )
            yield GaugeMetricFamily(
                "fastroute_proxy_weights_puller_active",
                "1 if this worker holds the local table's writer lock and pulls.",
                value=1.0 if puller.active else 0.0,
            )
        if reporter is not None:
            reports = CounterMetricFamily(
                "fastroute_proxy_reports", "Reports to the controller.", labels=["outcome"]
            )
            reports.add_metric(["sent"], reporter.sent_total)
            reports.add_metric(["failed"], reporter.failed_total)
            yield reports
        if scraper is not None:
            yield from _scrape_metrics(scraper)


def _scrape_metrics(scraper: EngineScraper) -> Iterator[Metric]:
    scrapes = CounterMetricFamily(
        "fastroute_proxy_engine_scrapes", "Engine /metrics scrapes.", labels=["engine"]
    )
    errors = CounterMetricFamily(
        "fastroute_proxy_engine_scrape_errors", "Failed engine scrapes.", labels=["engine"]
    )
    age = GaugeMetricFamily(
        "fastroute_proxy_engine_scrape_age_seconds",
        "Seconds since the engine's last good scrape (NaN: never).",
        labels=["engine"],
    )
    running = GaugeMetricFamily(
        "fastroute_proxy_engine_requests_running", "vLLM running requests.", labels=["engine"]
    )
    waiting = GaugeMetricFamily(
        "fastroute_proxy_engine_requests_waiting", "vLLM waiting requests.", labels=["engine"]
    )
    kv = GaugeMetricFamily(
        "fastroute_proxy_engine_kv_cache_usage",
        "vLLM KV-cache usage (1 = full).",
        labels=["engine"],
    )
    for name, r in scraper.results.items():
        scrapes.add_metric([name], r.scrapes_total)
        errors.add_metric([name], r.errors_total)
        a = r.age_s()
        age.add_metric([name], float("nan") if a is None else a)
        s = r.signals
        if s is not None:
            if s.num_requests_running is not None:
                running.add_metric([name], s.num_requests_running)
            if s.num_requests_waiting is not None:
                waiting.add_metric([name], s.num_requests_waiting)
            if s.kv_cache_usage is not None:
                kv.add_metric([name], s.kv_cache_usage)
    yield from (scrapes, errors, age, running, waiting, kv)
    yield from _prefix_cache_metrics(scraper)


def _prefix_cache_metrics(scraper: EngineScraper) -> Iterator[Metric]:
    """Each engine's windowed prefix-cache hit rate and the fleet's (token-weighted)."""
    ratio = GaugeMetricFamily(
        "fastroute_proxy_engine_prefix_cache_hit_ratio",
        "Prefix-cache hits per queried prompt token over the window, from the engine's own "
        "counters (absent: unknown or no traffic).",
        labels=["engine"],
    )
    queried = GaugeMetricFamily(
        "fastroute_proxy_engine_prefix_cache_queried_tokens",
        "Prompt tokens the engine looked up in its prefix cache within the window.",
        labels=["engine"],
    )
    window = GaugeMetricFamily(
        "fastroute_proxy_engine_prefix_cache_window_seconds",
        "Span of the hit-ratio window, seconds (NaN: since the engine started).",
        labels=["engine"],
    )
    rates = []
    for (name, r), stale in zip(scraper.results.items(), _stale_mask(scraper), strict=True):
        hit = r.prefix_hits.current
        if stale or hit.status == "unknown":
            continue  # a stale engine's window is no longer "the last minute"
        rates.append(hit)
        if hit.rate is not None:
            ratio.add_metric([name], hit.rate)
        if hit.queries_tokens is not None:
            queried.add_metric([name], hit.queries_tokens)
            span = hit.window_s
            window.add_metric([name], float("nan") if span is None else span)
    yield from (ratio, queried, window)
    fleet = fleet_hit_rate(rates)
    if fleet.rate is not None:
        yield GaugeMetricFamily(
            "fastroute_proxy_prefix_cache_hit_ratio",
            "Fleet prefix-cache hits per queried prompt token over the window (token-weighted "
            "over the engines with counters).",
            value=fleet.rate,
        )


def _stale_mask(scraper: EngineScraper) -> list[bool]:
    """Per engine: no good scrape within :data:`STALE_SCRAPE_INTERVALS` scrape intervals."""
    bound_s = STALE_SCRAPE_INTERVALS * scraper.interval_s
    ages = [r.age_s() for r in scraper.results.values()]
    return [a is None or a > bound_s for a in ages]


def _engine_state(ctx: ProxyContext) -> tuple[Mapping[int, int], Mapping[int, bool]]:
    """``(in_flight, ejected)`` by engine id for a report.

    ``in_flight`` is this worker's share (its own attempts), not the host-wide count
    of the stats block: every worker reports, and the controller adds the reports up.
    """
    fleet = ctx.fleet
    ids = [int(i) for i in fleet.engine_ids]
    available = fleet.outlier.available_mask(fleet.clock())
    in_flight = dict(zip(ids, fleet.caps.counts(), strict=True))
    ejected = dict(zip(ids, (not bool(a) for a in available), strict=True))
    return in_flight, ejected


def report_url_of(config: Config) -> str | None:
    """Where the proxy reports demand: ``proxy.controller_url``, else the controller of this
    host (the config's ``[controller]`` host and port; the table comes through shared memory,
    the demand must still reach the LP). None when that port is 0 (picked at start: unknown)."""
    if config.proxy.controller_url:
        return config.proxy.controller_url
    ctl = config.controller
    if ctl.port == 0:
        return None
    host = "127.0.0.1" if ctl.host in ("0.0.0.0", "::", "") else ctl.host
    return f"http://[{host}]:{ctl.port}" if ":" in host else f"http://{host}:{ctl.port}"


def _etcd_leader(config: Config) -> EtcdLeader | None:
    """The leader lookup of ``proxy.etcd_urls`` (key: ``proxy.leader_key``, else the
    ``[controller.ha]`` election key); None without etcd URLs."""
    proxy = config.proxy
    if not proxy.etcd_urls:
        return None
    key = proxy.leader_key or config.controller.ha.election_key
    return EtcdLeader(proxy.etcd_urls, key, proxy.etcd_timeout_s)


def install_signal_tasks(
    ctx: ProxyContext,
    config: Config,
    *,
    table_name: str | None = None,
    current_context: Callable[[], ProxyContext] | None = None,
) -> SignalTasks:
    """Build the configured signal-path components; their counters go on ``/metrics``.

    The caller starts them (:meth:`SignalTasks.start`) after its upstream pool and
    table watcher, and stops them (:meth:`SignalTasks.stop`) before those.

    Parameters
    ----------
    ctx : ProxyContext
        ``ctx.aggregator`` is set when reports have somewhere to go (:func:`report_url_of`).
    config : Config
    table_name : str, optional
        Local table the puller writes; default ``config.proxy.table_name``.
    current_context : callable, optional
        Returns the context in force (after config reloads); default ``ctx``. Its
        fleet supplies the in-flight counts and ejections of each report. A
        reloaded context must carry ``aggregator`` over from the previous one.

    Returns
    -------
    SignalTasks
        Not started yet.

    Notes
    -----
    The components are configured once, at startup: a reload that changes
    ``controller_url``, ``report_interval_s`` or the scrape settings takes effect
    at the next restart.
    """
    proxy = config.proxy
    tasks = SignalTasks()
    if ctx.models is None:
        ctx.models = ModelCatalog()
    tasks.models = ModelsScraper(
        ctx.models, lambda: (current_context() if current_context else ctx).config
    )
    report_url = report_url_of(config)
    if report_url is not None:
        tasks.aggregator = DemandAggregator(proxy.cluster, f"{socket.gethostname()}:{os.getpid()}")
        tasks.aggregator.proxy_id = proxy_id(config)
        ctx.aggregator = tasks.aggregator

        def calibration() -> FleetCalibration | None:
            return (current_context() if current_context else ctx).metrics.calibration

        tasks.reporter = Reporter(
            report_url,
            tasks.aggregator,
            interval_s=proxy.report_interval_s,
            engine_state=lambda: _engine_state(current_context() if current_context else ctx),
            calibration=calibration,
        )
        if calibration() is not None:
            tasks.calibration = CalibrationPull(report_url, calibration)
    if proxy.controller_url:  # a controller on this host writes the table into shared memory
        tasks.puller = WeightsPuller(
            proxy.controller_url,
            table_name or proxy.table_name,
            fallback_urls=proxy.controller_fallback_urls,
            cluster=proxy.cluster,
            leader=_etcd_leader(config),
            stale_table_max_age_s=proxy.stale_table_max_age_s,
        )
    if proxy.scrape_engines:
        tasks.scraper = EngineScraper(
            config.engines,
            interval_s=proxy.scrape_interval_s,
            timeout_s=proxy.scrape_timeout_s,
        )
    if tasks.scraper is not None:
        attach_scraper(ctx, tasks.scraper)  # the marginal-cost engine load merges scrapes
    if proxy.peers:
        context = current_context or (lambda: ctx)
        tasks.peers = PeerQueues(
            proxy.peers,
            lambda: context().fleet,
            interval_s=proxy.peer_poll_interval_s,
            admin_token=proxy.admin_token,
            key_exchange=(lambda: context().key_exchange) if proxy.peer_key_exchange else None,
        )
        ctx.metrics.registry.register(PeerQueuesCollector(tasks.peers))
    if tasks.puller is not None or tasks.reporter is not None or tasks.scraper is not None:
        ctx.metrics.registry.register(_SignalCollector(tasks))
    return tasks
