"""Prometheus metrics of one controller (``fastroute_controller_*``, its own registry)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.scrape import EngineScraper
from fastroute.signals.loop_tasks import loop_tasks
from fastroute.signals.prefix_cache import PrefixHitRate, fleet_hit_rate

__all__ = ["ControllerMetrics"]


class ControllerMetrics:
    """Prometheus metrics of one controller (its own registry).

    Parameters
    ----------
    registry : CollectorRegistry, optional
        Default: a new registry.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.solves = Counter(
            "fastroute_controller_solves", "LP solves by outcome status", ["status"], registry=r
        )
        self.solves_reused = Counter(
            "fastroute_controller_solves_reused",
            "Periods (also in solves_total) that reused the last solve's result: same LP inputs",
            registry=r,
        )
        self.solve_seconds = Histogram(
            "fastroute_controller_solve_seconds",
            "Wall time of one period's solve (build + HiGHS + weights)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.generation = Gauge(
            "fastroute_controller_table_generation", "Generation of the published table", registry=r
        )
        Gauge(
            "fastroute_controller_asyncio_tasks",
            "Tasks of the controller's event loop (a steady climb is a leak)",
            registry=r,
        ).set_function(loop_tasks)
        self.reports = Counter(
            "fastroute_controller_reports", "Proxy reports by outcome", ["outcome"], registry=r
        )
        self.tables_fenced = Counter(
            "fastroute_controller_tables_fenced",
            "Publications refused: the local table holds a newer controller epoch",
            registry=r,
        )
        self.leader = Gauge(
            "fastroute_controller_leader",
            "1 while this controller leads the election (or runs without one), else 0",
            registry=r,
        )
        self.epoch = Gauge(
            "fastroute_controller_epoch",
            "Epoch of the leader as this controller knows it (-1: unknown or no election)",
            registry=r,
        )
        self.alerts = Counter(
            "fastroute_controller_alerts",
            "Periods that kept the last good table, by reason",
            ["kind"],
            registry=r,
        )
        self.shed_fraction = Gauge(
            "fastroute_controller_shed_fraction", "Published shed fraction", ["class"], registry=r
        )
        self.demand_rps = Gauge(
            "fastroute_controller_demand_rps", "Forecast demand (req/s)", ["class"], registry=r
        )
        self.engine_health = Gauge(
            "fastroute_controller_engine_health",
            "Derating level h of the engine's capacity (1 healthy, 0 unavailable)",
            ["engine"],
            registry=r,
        )
        self.engine_reuse_gain = Gauge(
            "fastroute_controller_engine_reuse_gain",
            "Capacity gain of the engine group's measured prefix reuse (1: plans at capacity_rps)",
            ["engine"],
            registry=r,
        )
        self.engine_stale = Gauge(
            "fastroute_controller_engine_stale",
            "1 when the controller has no fresh /metrics scrape of the engine",
            ["engine"],
            registry=r,
        )
        self.engine_scrape_age = Gauge(
            "fastroute_controller_engine_scrape_age_seconds",
            "Age of the last good /metrics scrape of the engine (-1: never)",
            ["engine"],
            registry=r,
        )
        self.scrape_errors = Gauge(
            "fastroute_controller_engine_scrape_errors",
            "Failed scrapes of the engine since start",
            ["engine"],
            registry=r,
        )
        self._add_prefix_cache_metrics(r)
        self.config_reloads = Counter(
            "fastroute_controller_config_reloads",
            "SIGHUP config reloads by result (ok, unchanged, error)",
            ["result"],
            registry=r,
        )

    def _add_prefix_cache_metrics(self, r: CollectorRegistry) -> None:
        """The engines' prefix-cache hit ratios, per engine and for the fleet."""
        self.engine_prefix_hit_ratio = Gauge(
            "fastroute_controller_engine_prefix_cache_hit_ratio",
            "Prefix-cache hits per queried prompt token over the last minute, from the engine's "
            "own counters (absent: unknown, idle or stale)",
            ["engine"],
            registry=r,
        )
        self.engine_prefix_queried = Gauge(
            "fastroute_controller_engine_prefix_cache_queried_tokens",
            "Prompt tokens the engine looked up in its prefix cache within the window",
            ["engine"],
            registry=r,
        )
        self.prefix_hit_ratio = Gauge(
            "fastroute_controller_prefix_cache_hit_ratio",
            "Fleet prefix-cache hit ratio over the window, token-weighted (NaN: unknown or idle)",
            registry=r,
        )
        self.prefix_window = Gauge(
            "fastroute_controller_prefix_cache_window_seconds",
            "Span of the fleet's hit-ratio window, seconds (NaN: since the engines started)",
            registry=r,
        )

    def forget(self, engines: Sequence[str] = (), classes: Sequence[str] = ()) -> None:
        """Drop the per-engine and per-class series of engines / classes a reload removed."""
        for gauge, names in (
            (self.engine_health, engines),
            (self.engine_reuse_gain, engines),
            (self.engine_stale, engines),
            (self.engine_scrape_age, engines),
            (self.scrape_errors, engines),
            (self.engine_prefix_hit_ratio, engines),
            (self.engine_prefix_queried, engines),
            (self.shed_fraction, classes),
            (self.demand_rps, classes),
        ):
            for name in names:
                with contextlib.suppress(KeyError):
                    gauge.remove(name)

    def record_scrapes(
        self, engine_names: Sequence[str], scraper: EngineScraper, now_s: float
    ) -> None:
        """Set the per-engine scrape gauges (stale, age, errors) from ``scraper``'s state."""
        stale = scraper.stale(now_s)
        for i, name in enumerate(engine_names):
            st = scraper.states[i]
            age = st.age_s(now_s)
            self.engine_stale.labels(name).set(float(stale[i]))
            self.engine_scrape_age.labels(name).set(-1.0 if age is None else age)
            self.scrape_errors.labels(name).set(st.errors_total)
        self.record_prefix_hits(engine_names, scraper.prefix_hit_rates(now_s))

    def record_prefix_hits(
        self, engine_names: Sequence[str], rates: Sequence[PrefixHitRate]
    ) -> None:
        """Set the prefix-cache gauges: each engine's window (series absent when its rate is
        not known) and the fleet's token-weighted figure."""
        for name, hit in zip(engine_names, rates, strict=True):
            for gauge, value in (
                (self.engine_prefix_hit_ratio, hit.rate),
                (self.engine_prefix_queried, hit.queries_tokens),
            ):
                if value is None:
                    with contextlib.suppress(KeyError):
                        gauge.remove(name)
                else:
                    gauge.labels(name).set(value)
        fleet = fleet_hit_rate(rates)
        nan = float("nan")
        self.prefix_hit_ratio.set(nan if fleet.rate is None else fleet.rate)
        span = fleet.window_s
        self.prefix_window.set(nan if span is None else span)
