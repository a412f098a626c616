"""Prometheus metrics of the proxy, all declared here, on a per-app registry.

=========================================  =========  =================================
name                                       type       labels / meaning
=========================================  =========  =================================
``fastroute_proxy_requests_total``         counter    class, engine, status: responses
``fastroute_proxy_ttft_seconds``           histogram  class, engine: arrival → first chunk
``fastroute_proxy_tbot_seconds``           histogram  class, engine: mean gap between chunks
``fastroute_proxy_e2e_seconds``            histogram  class, engine: arrival → last byte
``fastroute_proxy_retries_total``          counter    attempts after the first
``fastroute_proxy_retry_refused_total``    counter    retries the budget refused
``fastroute_proxy_broken_streams_total``   counter    outcome: streams whose engine failed once
                                                      the client's stream had begun —
                                                      ``migrated`` (finished on another engine),
                                                      ``failed`` (its continuations failed),
                                                      ``not_migrated`` (no continuation tried)
``fastroute_proxy_migrations_total``       counter    reason: streams continued on another
                                                      engine mid-stream — ``drain`` (handed
                                                      off a draining engine), ``error``
                                                      (in-stream error event, refused
                                                      continuation), ``timeout`` (idle),
                                                      ``connection`` (reset or dropped)
``fastroute_proxy_hedges_total``           counter    outcome: hedged first tokens — ``won``
                                                      (the runner-up's token came first),
                                                      ``lost`` (the first engine's did),
                                                      ``cancelled`` (neither: both failed or
                                                      the client left before a first token),
                                                      ``refused`` (budget,
                                                      shedding or no runner-up)
``fastroute_proxy_upstream_failures_total`` counter   engine, kind (connect_error, ...)
``fastroute_proxy_ejections_total``        counter    engine: local outlier ejections
``fastroute_proxy_shed_total``             counter    class, reason (shed, admission)
``fastroute_proxy_in_flight``              gauge      requests being handled
``fastroute_proxy_table_generation``       gauge      weight-table generation (0 fallback)
``fastroute_proxy_table_age_seconds``      gauge      now − the table's publish time
``fastroute_proxy_asyncio_tasks``          gauge      tasks of the worker's event loop (a
                                                      steady climb is a leak; the soak reads it)
``fastroute_proxy_calibration_coefficient`` gauge     type, coef: step-time coefficient (s)
``fastroute_proxy_calibration_samples``    gauge      type, kind: observations folded in
``fastroute_proxy_calibration_abs_rel_error`` gauge   type: EWMA of |relative error|
``fastroute_proxy_calibration_sigma_rel``  gauge      type: robust relative residual scale
``fastroute_proxy_calibration_p90_factor`` gauge      type, kind: conformal p90 factor
``fastroute_proxy_key_log_entries_total``  counter    outcome: other workers' entries of the
                                                      host's key log this worker read —
                                                      ``observed`` (into its prefix tables),
                                                      ``lost`` (overwritten before it read
                                                      them, or torn by their writer)
=========================================  =========  =================================

The ``calibration`` families exist only when a class uses ``marginal-cost``
(:attr:`ProxyMetrics.calibration`); ``type`` is the engine ``hardware`` name, or
``kv-transfer`` for the P→D transfer model (coefs ``latency_s``, ``s_per_token``,
kind ``transfer``).

``engine`` is ``"none"`` for requests answered before an engine was chosen. A
per-app :class:`~prometheus_client.CollectorRegistry` keeps several apps in one
process (tests) apart.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fastroute.predict.calibration import FleetCalibration
from fastroute.signals.loop_tasks import loop_tasks

__all__ = ["ProxyMetrics", "PendingHistogram", "LATENCY_BUCKETS_S", "TBOT_BUCKETS_S"]

#: Buckets of TTFT and end-to-end latency, seconds.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
#: Buckets of time between output tokens, seconds.
TBOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)


class ProxyMetrics:
    """The proxy's metric families on their own registry.

    Parameters
    ----------
    table_published_at : callable
        Returns the publish time (Unix seconds) of the current weight table, or None
        when the fallback weights are in use; read at scrape time for the table age.
    """

    def __init__(self, table_published_at: Callable[[], float | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "fastroute_proxy_requests",
            "Responses by class, engine and HTTP status.",
            ["class", "engine", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "fastroute_proxy_ttft_seconds",
            "Arrival to the first streamed chunk sent to the client.",
            ["class", "engine"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tbot = Histogram(
            "fastroute_proxy_tbot_seconds",
            "Mean time between streamed chunks of one response.",
            ["class", "engine"],
            buckets=TBOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "fastroute_proxy_e2e_seconds",
            "Arrival to the last byte sent to the client.",
            ["class", "engine"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            "fastroute_proxy_retries", "Attempts after the first one.", registry=r
        )
        self.retry_refused = Counter(
            "fastroute_proxy_retry_refused", "Retries refused by the retry budget.", registry=r
        )
        self.broken_streams = Counter(
            "fastroute_proxy_broken_streams",
            "Streams whose engine failed once the client's stream had begun, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.migrations = Counter(
            "fastroute_proxy_migrations",
            "Mid-stream migrations by reason (drain, error, timeout, connection).",
            ["reason"],
            registry=r,
        )
        self.hedges = Counter(
            "fastroute_proxy_hedges",
            "Hedged first tokens by outcome (won, lost, cancelled, refused).",
            ["outcome"],
            registry=r,
        )
        self.upstream_failures = Counter(
            "fastroute_proxy_upstream_failures",
            "Failed upstream attempts by engine and kind.",
            ["engine", "kind"],
            registry=r,
        )
        self.ejections = Counter(
            "fastroute_proxy_ejections",
            "Local outlier ejections by engine.",
            ["engine"],
            registry=r,
        )
        self.shed = Counter(
            "fastroute_proxy_shed",
            "Requests rejected with 429 by class and reason.",
            ["class", "reason"],
            registry=r,
        )
        self.tenant_admitted = Counter(
            "fastroute_proxy_tenant_admitted",
            "Requests of a tenant with limits admitted by its share.",
            ["tenant"],
            registry=r,
        )
        self.tenant_rejected = Counter(
            "fastroute_proxy_tenant_rejected",
            "Requests of a tenant refused with 429 by the limit that refused them "
            "(requests, tokens, concurrent).",
            ["tenant", "limit"],
            registry=r,
        )
        #: Requests being handled; a plain int (the request path adds ±1), read at scrape
        #: time: a prometheus ``Gauge.inc`` takes a lock, twice per request.
        self.in_flight_count = 0
        self.in_flight = Gauge("fastroute_proxy_in_flight", "Requests being handled.", registry=r)
        self.in_flight.set_function(lambda: float(self.in_flight_count))
        self.table_generation = Gauge(
            "fastroute_proxy_table_generation",
            "Weight-table generation in use (0: capacity-proportional fallback).",
            registry=r,
        )
        age = Gauge(
            "fastroute_proxy_table_age_seconds",
            "Seconds since the weight table in use was published (NaN: fallback).",
            registry=r,
        )

        def table_age() -> float:
            published = table_published_at()
            return float("nan") if published is None else max(0.0, time.time() - published)

        age.set_function(table_age)
        tasks = Gauge(
            "fastroute_proxy_asyncio_tasks",
            "Tasks of this worker's event loop (a steady climb is a leak).",
            registry=r,
        )
        tasks.set_function(loop_tasks)
        # Labelled children by label values: ``labels(...)`` validates and locks on every
        # call (~2 % of a worker's CPU per request); the label sets are few and fixed.
        self._request_children: dict[tuple[str, str, int], Any] = {}
        # Responses counted since the last flush into ``requests``, by label values
        # (bounded like the children: classes x engines x statuses).
        self._request_counts: dict[tuple[str, str, int], int] = {}
        # Histogram observations since the last flush, per labelled child (same bound).
        self._e2e_children: dict[tuple[str, str], PendingHistogram] = {}
        self._ttft_children: dict[tuple[str, str], PendingHistogram] = {}
        self._tbot_children: dict[tuple[str, str], PendingHistogram] = {}
        #: The ``marginal-cost`` policy's calibration, exported at scrape time; None
        #: without one (set per config by ``install_marginal``).
        self.calibration: FleetCalibration | None = None
        r.register(_CalibrationCollector(self))
        #: The key logs of the policies in use (``fastroute._core.KeyLog``), read at
        #: scrape time; what replaced ones counted is kept in ``_key_log_base``.
        self.key_logs: list[Any] = []
        self._key_log_base = [0, 0]
        r.register(_KeyLogCollector(self))

    def use_key_logs(self, logs: list[Any]) -> None:
        """The policies now use ``logs`` (a reload): keep what the old ones counted."""
        for log in self.key_logs:
            self._key_log_base[0] += log.observed
            self._key_log_base[1] += log.lost
        self.key_logs = list(logs)

    def key_log_counts(self) -> tuple[int, int] | None:
        """(observed, lost) entries of the key log over this worker's life; None if it
        never had one."""
        if not self.key_logs and not any(self._key_log_base):
            return None
        observed, lost = self._key_log_base
        for log in self.key_logs:
            observed += log.observed
            lost += log.lost
        return observed, lost

    def count_request(self, class_name: str, engine: str, status: int) -> None:
        """Count one response; folded into ``requests`` by :meth:`flush` (at scrape time)."""
        key = (class_name, engine, status)
        counts = self._request_counts
        counts[key] = counts.get(key, 0) + 1

    def flush(self) -> None:
        """Add the responses and observations counted since the last flush."""
        for children in (self._e2e_children, self._ttft_children, self._tbot_children):
            for pending in children.values():
                pending.flush()
        counts, self._request_counts = self._request_counts, {}
        for key, n in counts.items():
            child = self._request_children.get(key)
            if child is None:
                class_name, engine, status = key
                child = self._request_children[key] = self.requests.labels(
                    class_name, engine, str(status)
                )
            child.inc(n)

    def e2e_of(self, class_name: str, engine: str) -> PendingHistogram:
        """Where to ``observe`` ``e2e{class_name, engine}`` (folded in at scrape time)."""
        return _child(self._e2e_children, self.e2e, class_name, engine)

    def ttft_of(self, class_name: str, engine: str) -> PendingHistogram:
        """Where to ``observe`` ``ttft{class_name, engine}`` (folded in at scrape time)."""
        return _child(self._ttft_children, self.ttft, class_name, engine)

    def tbot_of(self, class_name: str, engine: str) -> PendingHistogram:
        """Where to ``observe`` ``tbot{class_name, engine}`` (folded in at scrape time)."""
        return _child(self._tbot_children, self.tbot, class_name, engine)

    def render(self) -> bytes:
        """The text exposition of every metric (pending counts flushed first)."""
        self.flush()
        return generate_latest(self.registry)


class PendingHistogram:
    """Observations of one labelled histogram child, added to it at scrape time.

    prometheus-client's ``Histogram.observe`` takes a lock per bucket and per sum and
    walks the bounds in Python; this keeps plain bucket counts and a sum (the loop
    thread is the only writer) and :meth:`flush` adds them to the child, so the
    exposition is the same as observing each value there.

    Parameters
    ----------
    child : prometheus_client.Histogram
        The labelled child (``family.labels(...)``).
    """

    __slots__ = ("child", "_bounds", "_counts", "_sum")

    def __init__(self, child: Any) -> None:
        self.child = child
        # The child's upper bounds, +Inf last: value v goes to the first bound >= v.
        self._bounds: list[float] = list(child._upper_bounds)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        """Count one observation (seconds)."""
        if amount == amount:  # NaN: no bucket takes it, as in prometheus-client
            self._counts[bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def flush(self) -> None:
        """Add what was observed since the last flush to the child."""
        counts = self._counts
        if not any(counts) and self._sum == 0.0:
            return
        total, self._sum = self._sum, 0.0
        self._counts = [0] * len(counts)
        buckets = self.child._buckets
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)
        self.child._sum.inc(total)


def _child(
    cache: dict[tuple[str, str], PendingHistogram], family: Any, a: str, b: str
) -> PendingHistogram:
    child = cache.get((a, b))
    if child is None:
        child = cache[(a, b)] = PendingHistogram(family.labels(a, b))
    return child


class _KeyLogCollector(Collector):
    """Exports :meth:`ProxyMetrics.key_log_counts` at scrape time (nothing without a log)."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        counts = self.metrics.key_log_counts()
        if counts is None:
            return []
        family = CounterMetricFamily(
            "fastroute_proxy_key_log_entries",
            "Other workers' entries of the host's key log this worker read, by outcome "
            "(observed into its prefix tables; lost: overwritten before it read them, or "
            "torn by their writer).",
            labels=["outcome"],
        )
        family.add_metric(["observed"], counts[0])
        family.add_metric(["lost"], counts[1])
        return [family]


class _CalibrationCollector(Collector):
    """Exports :attr:`ProxyMetrics.calibration` at scrape time (labels: engine type,
    coefficient or kind: a handful of series per engine type)."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        cal = self.metrics.calibration
        if cal is None:
            return []
        coef = GaugeMetricFamily(
            "fastroute_proxy_calibration_coefficient",
            "Calibrated step-time coefficient of an engine type, seconds (per token, "
            "per sequence... as named).",
            labels=["type", "coef"],
        )
        samples = GaugeMetricFamily(
            "fastroute_proxy_calibration_samples",
            "Timings folded into the calibration of an engine type, by kind.",
            labels=["type", "kind"],
        )
        err = GaugeMetricFamily(
            "fastroute_proxy_calibration_abs_rel_error",
            "EWMA of the absolute relative prediction error (out of sample).",
            labels=["type"],
        )
        sigma = GaugeMetricFamily(
            "fastroute_proxy_calibration_sigma_rel",
            "Robust relative scale of the calibration residuals.",
            labels=["type"],
        )
        p90 = GaugeMetricFamily(
            "fastroute_proxy_calibration_p90_factor",
            "Split-conformal p90 factor (prediction times it bounds 90 % of timings).",
            labels=["type", "kind"],
        )
        snap = cal.snapshot()
        for name, state in sorted(snap.types.items()):
            for c, value in state.coef.items():
                coef.add_metric([name, c], value)
            for kind, n in sorted(state.samples_by_kind.items()):
                samples.add_metric([name, kind], n)
            err.add_metric([name], state.abs_rel_err)
            sigma.add_metric([name], state.sigma_rel)
            for kind, factor in sorted(state.p90_factor.items()):
                p90.add_metric([name, kind], factor)
        tx = snap.transfer
        coef.add_metric(["kv-transfer", "latency_s"], tx.latency_s)
        coef.add_metric(["kv-transfer", "s_per_token"], tx.s_per_token)
        samples.add_metric(["kv-transfer", "transfer"], tx.n_samples)
        return [coef, samples, err, sigma, p90]
