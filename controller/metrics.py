"""Prometheus metrics of one controller (``fastroute_controller_*``, its own registry)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.scrape import EngineScraper

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
        self.reports = Counter(
            "fastroute_controller_reports", "Proxy reports by outcome", ["outcome"], registry=r
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
        self.config_reloads = Counter(
            "fastroute_controller_config_reloads",
            "SIGHUP config reloads by result (ok, unchanged, error)",
            ["result"],
            registry=r,
        )

    def forget(self, engines: Sequence[str] = (), classes: Sequence[str] = ()) -> None:
        """Drop the per-engine and per-class series of engines / classes a reload removed."""
        for gauge, names in (
            (self.engine_health, engines),
            (self.engine_stale, engines),
            (self.engine_scrape_age, engines),
            (self.scrape_errors, engines),
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
